"""mlp-tanh: a multilayer perceptron with tanh activations for tabular features.

The tabular counterpart of ``cnn-tanh-gn``: bounded activations keep the per-sample gradients
that clipping cuts from exploding (Papernot, Thakurta, Song, Chien & Erlingsson, "Tempered
Sigmoid Activations for Deep Learning with Differential Privacy", AAAI 2021, §4-5), and a small
model keeps the noise's norm, which grows with √(parameters), small. ``depth`` hidden layers of
``width`` units (linear → tanh), then a linear classifier. Written DP-ready: no BatchNorm, biases
everywhere, no in-place ops.
"""

from __future__ import annotations

from torch import nn

from ..errors import OverrideError
from ..registry import ModelCard, register_model
from ._common import from_scratch

__all__ = ["TanhMLP"]

NAME = "mlp-tanh"


class TanhMLP(nn.Module):
    """``depth`` hidden layers (linear, tanh) of ``width`` units on ``in_features``, then a linear classifier."""

    def __init__(self, in_features: int = 64, num_classes: int = 10, width: int = 64, depth: int = 2):
        super().__init__()
        if depth < 0 or width < 1 or in_features < 1:
            raise OverrideError(
                f"{NAME}: depth must be ≥ 0, width and in_features ≥ 1 (got {depth}, {width}, {in_features})."
            )
        layers: list[nn.Module] = []
        c = in_features
        for _ in range(depth):
            layers += [nn.Linear(c, width), nn.Tanh()]
            c = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x.flatten(1)))


_CARD = ModelCard(
    name=NAME,
    summary="A tanh MLP for tabular features (a CSV or Parquet file from the CLI), DP-ready from scratch.",
    architecture="dpzoo `TanhMLP`: [linear → tanh] × depth, linear",
    library="dpzoo",
    task="tabular-classification",
    patches=("written DP-ready: no normalisation layers, biases on every layer, no in-place ops",),
    license="Apache-2.0",
    papers=(
        "Papernot et al., Tempered Sigmoid Activations for Deep Learning with Differential Privacy, AAAI 2021, §4-5",
    ),
    overrides={
        "in_features": "input features (default 64; dpzoo train sets it from the data)",
        "num_classes": "output classes (default 10)",
        "width": "units per hidden layer (default 64)",
        "depth": "hidden layers (default 2; 0 is logistic regression)",
    },
    test_overrides={"num_classes": 10},  # small already (9k parameters)
    train_defaults={"epochs": 30, "batch_size": 256, "lr": 1e-2},
    example_input={"kind": "features", "shape": [64]},
    notes=(
        "`dpzoo train mlp-tanh --data table.csv --label-column label` trains it on your own table (every other "
        "column a numeric feature, used as it is: scale features with bounds known without the private rows); "
        "`--data digits` uses the bundled digits as 64 features. No pretrained weights."
    ),
)


@register_model(NAME, card=_CARD)
def mlp_tanh(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides) -> nn.Module:
    return from_scratch(_CARD, TanhMLP, pretrained, pretrained_tag, weights, overrides)
