"""Converts torchvision ResNet weights to this project's backbone layout, once, ahead of training.

  python -m detector.convert_pretrained --input=resnet50.pth --output=resnet50_backbone.npz

then train with `--config.model.backbone.norm=frozen_bn
--config.model.backbone.pretrained=resnet50_backbone.npz`. The input is a
torchvision state dict as `.pth`/`.pt` (needs torch), `.safetensors` or
`.npz`; the output is a flat `.npz` (`stage1_block1/Conv_0/kernel`, ...)
that needs neither torch nor a conversion at training time. Stage sizes
and width come from the state dict, so ResNet-18/34/101/152 convert too.
Nothing is downloaded.
"""

from __future__ import annotations

from absl import flags

from detector import cli
from detector.errors import ConfigError
from detector.models import weight_import

_INPUT = flags.DEFINE_string("input", None, "torchvision ResNet state dict: .pth, .pt, .safetensors or .npz.")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the converted backbone (.npz).")
flags.mark_flags_as_required(["input", "output"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    if not _OUTPUT.value.endswith(".npz"):
        raise ConfigError(
            f"--output={_OUTPUT.value}: the converted backbone is written as .npz; give a name ending in .npz"
        )
    state_dict = weight_import.read_state_dict(_INPUT.value)
    stage_sizes = weight_import.torchvision_stage_sizes(state_dict)
    backbone = weight_import.flatten_backbone_params(weight_import.convert_torchvision_resnet(state_dict, stage_sizes))
    weight_import.save_backbone_params(backbone, _OUTPUT.value)

    ignored = weight_import.ignored_torchvision_keys(state_dict)
    counters = [name for name in ignored if name.endswith("num_batches_tracked")]
    others = [name for name in ignored if name not in counters]
    ignored_text = ", ".join(others + ([f"{len(counters)} num_batches_tracked counters"] if counters else []))
    block = "bottleneck" if "layer1.0.conv3.weight" in state_dict else "basic"
    width = backbone["stem_conv/kernel"].shape[-1]
    num_values = sum(value.size for value in backbone.values())
    print(f"{_INPUT.value}: ResNet with {block} blocks, stage sizes {stage_sizes}, width {width}")
    print(
        f"converted {len(state_dict) - len(ignored)} tensors into {len(backbone)} arrays "
        f"({num_values / 1e6:.2f}M values; BatchNorms folded into frozen scale/bias)"
    )
    print(f"ignored: {ignored_text or 'nothing'}")
    print(
        f"wrote {_OUTPUT.value}; train with --config.model.backbone.norm=frozen_bn "
        f"--config.model.backbone.pretrained={_OUTPUT.value}"
    )


if __name__ == "__main__":
    cli.run(main)
