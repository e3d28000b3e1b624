"""The built-in zoo entries. Importing this package registers them (the sequential-recommendation
entries live with their models in :mod:`dpzoo.seqrec.zoo`)."""

from ..seqrec import zoo as _seqrec_zoo
from . import bert, cnn, convnext, efficientnet, gemma, gpt2, llama, mistral, mlp, nfnet, qwen2, resnet, t5, vit, wrn  # noqa: F401

_seqrec_zoo.register()  # transformer-seqrec, transformer-seqrec-untied, dpformer, gru-seqrec, lstm-seqrec
