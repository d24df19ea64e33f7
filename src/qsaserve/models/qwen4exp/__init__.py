"""Qwen4Exp (Qwen3.8-Flash-Next) text model as a module tree, read top to bottom:

  config.py           parse_config, layer-type names, what is supported
  sharding.py         which part of each checkpoint tensor this rank keeps (RankLayout, Shard)
  weights.py          checkpoint names and shapes, the parameters' weight_loaders, loading and
                      dummy weights
  state.py            per-request state slots and the per-step description of the batch
  hyper_connection.py HyperConnection (the stream mixer between blocks)
  ple.py              PLE (hashed n-gram per-layer embedding)
  gated_deltanet.py   GatedDeltaNet (linear attention, recurrent state)
  qsa_attention.py    QSAAttention (indexer-selected sparse attention over paged K/V)
  moe.py              SparseMoE (routed + shared experts)
  decoder_layer.py    Qwen4ExpDecoderLayer
  model.py            Qwen4ExpModel, Qwen4ExpForCausalLM
"""
from qsaserve.models.qwen4exp.config import GDN, QSA_NAMES, parse_config
from qsaserve.models.qwen4exp.model import Qwen4ExpForCausalLM, Qwen4ExpModel
from qsaserve.models.qwen4exp.weights import weight_shapes

__all__ = ["GDN", "QSA_NAMES", "Qwen4ExpForCausalLM", "Qwen4ExpModel", "parse_config", "weight_shapes"]
