"""timm ResNet blocks without in-place operations.

timm's ``BasicBlock`` / ``Bottleneck`` end with ``x += shortcut`` and an in-place ReLU.
Autograd backward hooks (Opacus' and dpzoo's) wrap each module's output in a view, and
modifying that view in place fails ("Output 0 of BackwardHookFunction is a view and is
being modified inplace"). These subclasses compute the same function out of place; dpzoo
swaps them in by class (``module.__class__ = DPBasicBlock``), keeping every parameter.
"""

from __future__ import annotations

import torch
from timm.models.resnet import BasicBlock, Bottleneck


class DPBasicBlock(BasicBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.drop_block(x)
        x = self.act1(x)
        x = self.aa(x)
        x = self.conv2(x)
        x = self.bn2(x)
        if self.se is not None:
            x = self.se(x)
        if self.drop_path is not None:
            x = self.drop_path(x)
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        return self.act2(x + shortcut)  # out of place: safe under backward hooks


class DPBottleneck(Bottleneck):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.act1(x)
        x = self.conv2(x)
        x = self.bn2(x)
        x = self.drop_block(x)
        x = self.act2(x)
        x = self.aa(x)
        x = self.conv3(x)
        x = self.bn3(x)
        if self.se is not None:
            x = self.se(x)
        if self.drop_path is not None:
            x = self.drop_path(x)
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        return self.act3(x + shortcut)
