"""The configuration of dpzoo's next-item models: one dataclass, :class:`SeqRecConfig`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SeqRecConfig"]


@dataclass
class SeqRecConfig:
    num_items: int = 3416  # MovieLens-1M after SASRec preprocessing
    max_len: int = 200
    d_model: int = 64
    num_heads: int = 1
    num_blocks: int = 2
    ffn_mult: int = 1  # feed-forward width = ffn_mult * d_model (SASRec's point-wise FFN)
    dropout: float = 0.2
    tied: bool = True
    reattention: bool = False  # DPFormer's Re-Attention (§5.2); no trainable parameters

    def to_dict(self) -> dict:
        return asdict(self)
