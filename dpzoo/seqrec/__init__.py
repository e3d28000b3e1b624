"""Sequential recommendation with user-level DP: DPFormer and its baselines.

One job per module:

* :mod:`~dpzoo.seqrec.configuration`: :class:`SeqRecConfig`.
* :mod:`~dpzoo.seqrec.modeling`: the networks (causal attention, pre-norm block,
  :class:`SeqRecTransformer`, the GRU / LSTM :class:`SeqRecRNN`).
* :mod:`~dpzoo.seqrec.reattention`: Re-Attention: its state, the variance propagation and the
  score correction, applied by wrapping a block.
* :mod:`~dpzoo.seqrec.zoo`: the zoo entries (``transformer-seqrec``, ``-untied``, ``dpformer``,
  ``gru-seqrec``, ``lstm-seqrec``), registered when :mod:`dpzoo.models` is imported.
* :mod:`~dpzoo.seqrec.formats`: rating-file formats (parsing and sniffing).
* :mod:`~dpzoo.seqrec.dataset`: :class:`SequenceDataset` and SASRec's preprocessing.
* :mod:`~dpzoo.seqrec.downloads`: named datasets (:class:`DatasetSpec`, :func:`register_dataset`),
  their lookup and download; :func:`load_dataset`.
* :mod:`~dpzoo.seqrec.synthetic`: a long-tailed synthetic generator.
* :mod:`~dpzoo.seqrec.metrics`: NDCG@k / HIT@k over the full item set.
* :mod:`~dpzoo.seqrec.memory`: the physical batch size chosen from the available memory
  (``max_physical_batch_size="auto"``).
* :mod:`~dpzoo.seqrec.train`: private training and evaluation (``dpzoo train``).
"""

from .configuration import SeqRecConfig
from .dataset import SequenceDataset, dataset_from_file, sasrec_preprocess
from .downloads import DATASETS, DatasetSpec, load_dataset, register_dataset
from .formats import DataFormatError
from .modeling import SeqRecRNN, SeqRecTransformer
from .reattention import ReAttention, ReAttentionBlock

__all__ = [
    "SeqRecConfig",
    "SeqRecTransformer",
    "SeqRecRNN",
    "ReAttention",
    "ReAttentionBlock",
    "SequenceDataset",
    "sasrec_preprocess",
    "dataset_from_file",
    "load_dataset",
    "DATASETS",
    "DatasetSpec",
    "register_dataset",
    "DataFormatError",
]
