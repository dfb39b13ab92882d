"""One conversion worker process: images [start, stop) of a parsed COCO table into one part of a split.

  python -m input_pipeline.datasets.conversion_worker SPEC_JSON

SPEC_JSON: {"table": column-files directory, "image_root", "start", "stop",
"out": the split's temporary directory, "shard_bytes", "threads"}. Started
by conversion.py; prints the number of images done so far on stdout (a
line every _REPORT_EVERY images and one at the end). A DatasetError (a full
disk, for one) ends it with `error: MESSAGE` as the last line of stderr
and exit status 3.
"""

from __future__ import annotations

import collections
import json
import sys

from input_pipeline.dataset_errors import DatasetError
from input_pipeline.datasets import coco_images, split_writer
from input_pipeline.datasets.column_files import ColumnFiles

_REPORT_EVERY = 64
_DATASET_ERROR_EXIT = 3


def main(spec: dict) -> None:
    counts = collections.Counter()
    columns = ColumnFiles.open(spec["table"])
    start, stop = int(spec["start"]), int(spec["stop"])
    examples = coco_images.iter_table_examples(columns, spec["image_root"], counts, start, stop, int(spec["threads"]))
    for written in split_writer.write_part(
        spec["out"], start, examples, counts=counts, shard_bytes=int(spec["shard_bytes"])
    ):
        if written % _REPORT_EVERY == 0:
            print(coco_images.images_examined(counts), flush=True)
    print(coco_images.images_examined(counts), flush=True)


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(_DATASET_ERROR_EXIT)
