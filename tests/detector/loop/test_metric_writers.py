"""Metric files of a resumed run: nothing past the checkpoint it resumes from, nothing cut short."""

import json

from detector.loop.metric_writers import EVAL_METRICS_FILE, TRAIN_METRICS_FILE, MetricWriter


def test_resuming_drops_lines_past_the_checkpoint_and_cut_lines(tmp_path):
    writer = MetricWriter(str(tmp_path), enabled=True)
    for step in range(1, 6):
        writer.write_train(step, {"loss": 1.0 / step})
    writer.write_eval(4, {"AP": 0.1})
    writer.close()
    with (tmp_path / TRAIN_METRICS_FILE).open("a") as f:
        f.write('{"step": 6, "lo')  # a kill in the middle of a write

    resumed = MetricWriter(str(tmp_path), enabled=True)
    resumed.discard_after(3)  # the newest checkpoint was step 3
    resumed.write_train(4, {"loss": 0.5})
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / TRAIN_METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert lines[-1]["loss"] == 0.5
    assert (tmp_path / EVAL_METRICS_FILE).read_text() == ""


def test_a_fresh_start_or_other_processes_leave_the_files_alone(tmp_path):
    MetricWriter(str(tmp_path), enabled=False).discard_after(0)
    assert not (tmp_path / TRAIN_METRICS_FILE).exists()
    MetricWriter(str(tmp_path), enabled=True).discard_after(0)  # no files yet: nothing to do
    assert not (tmp_path / TRAIN_METRICS_FILE).exists()


def test_an_evaluation_of_a_step_written_again_replaces_the_first(tmp_path):
    """A finished run evaluated again (the same command once more) leaves one line for its last step."""
    writer = MetricWriter(str(tmp_path), enabled=True)
    writer.write_eval(4, {"AP": 0.1})
    writer.write_eval(8, {"AP": 0.2})
    assert writer.eval_steps() == {4, 8}
    writer.write_eval(8, {"AP": 0.3})
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / EVAL_METRICS_FILE).read_text().splitlines()]
    assert [(line["step"], line["AP"]) for line in lines] == [(4, 0.1), (8, 0.3)]
    assert MetricWriter(str(tmp_path), enabled=False).eval_steps() == set()  # other processes read nothing
