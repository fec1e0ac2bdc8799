"""What the names in a parameter tree say: logical axis names, and the names of modules.

**Axis names.** Flax metadata names each axis of a parameter (:func:`axis_kinds`). Names from a
known vocabulary say what the axis is: the model axis ``embed``; ``heads`` / ``kv_heads``;
``kv`` / ``head_dim``; ``mlp``; ``vocab``; stacked ``layers``; ``exp`` (experts); fused ``qkv``.
Mesh axis names (``'data'``, ``'model'``) say nothing, and neither do names whose count differs
from the number of axes.

**Module names** decide what metadata and shapes cannot: which projection of an attention layer
is the query and which the key (:func:`projection_name`), which side of a 2-D kernel is the model
width (:func:`io_side`), which kernels hold several projections side by side
(:func:`fused_role`), and the usual names of norms, biases, embeddings and output heads.
"""

from __future__ import annotations

import re
from typing import Optional

from stablejax.layout.leaves import AxisName, Leaf

# ------------------------------------------------------------------ axis names

MODEL, HEADS, HEAD_DIM, MLP, VOCAB, STACK, EXPERT, FUSED, NORM = (
    "model", "heads", "head_dim", "mlp", "vocab", "stack", "expert", "fused", "norm")
# A 'qkv' / 'kv' axis that is not a small batch axis of 2 or 3 but the features of the fused
# projections one after the other ([D, 3 * H * hd] named ('embed', 'qkv')).
FUSED_FEATURES = "fused_features"
_FUSED_PARTS = {"qkv": 3, "fused_qkv": 3, "kv": 2}
# Axes that are batch axes of a kernel's matrix: stacked layers, experts, fused projections.
BATCH_KINDS = (STACK, EXPERT, FUSED)

_KIND_OF_NAME = {
    **dict.fromkeys(("embed", "embedding", "emb", "d_model", "dmodel", "model_dim", "embed_dim"),
                    MODEL),
    **dict.fromkeys(("heads", "q_heads", "kv_heads", "num_heads", "n_heads", "head", "q_head",
                     "kv_head", "query_heads", "key_heads"), HEADS),
    **dict.fromkeys(("kv", "head_dim", "kv_head_dim", "q_head_dim", "qkv_dim", "hd", "joined_kv",
                     "kv_dim", "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(("mlp", "ffn", "ff", "mlp_dim", "intermediate", "hidden", "ff_dim"), MLP),
    **dict.fromkeys(("vocab", "vocab_size", "vocabulary"), VOCAB),
    **dict.fromkeys(("layers", "layer", "stage", "stages", "stack", "num_layers", "scan", "repeat",
                     "circular_repeats"), STACK),
    **dict.fromkeys(("exp", "expert", "experts", "num_experts"), EXPERT),
    **dict.fromkeys(("qkv", "fused_qkv"), FUSED),
    **dict.fromkeys(("norm",), NORM),
}


def _kind(name: AxisName) -> Optional[str]:
  names = name if isinstance(name, tuple) else (name,)
  for n in names:
    if isinstance(n, str):
      k = _KIND_OF_NAME.get(n.lower())
      if k is None and n.lower().startswith("embed"):
        k = MODEL  # MaxText's embed_no_exp and the like
      if k is not None:
        return k
  return None


def axis_kinds(leaf: Leaf) -> Optional[tuple[Optional[str], ...]]:
  """What each axis of ``leaf`` is by its metadata, or None when the metadata says nothing.

  The names must be as many as the axes and at least one must be a known logical name.
  """
  if leaf.axes is None or len(leaf.axes) != len(leaf.shape):
    return None
  kinds = [_kind(n) for n in leaf.axes]
  if not any(kinds):
    return None
  has_heads = any(k in (HEADS, HEAD_DIM) for i, k in enumerate(kinds)
                  if str(leaf.axes[i]).lower() != "kv")
  for i, (name, k) in enumerate(zip(leaf.axes, kinds)):
    # 'kv' names the per-head feature axis in T5X-style models, but a 'kv' axis of 2 or 3 next to
    # a heads axis is a fused key/value (or query/key/value) axis.
    if k == HEAD_DIM and str(name).lower() == "kv" and leaf.shape[i] in (2, 3) and has_heads:
      kinds[i] = FUSED
    # A fused axis of a 2-D kernel is not a batch axis: the projections lie side by side in it.
    if k == FUSED and len(leaf.shape) == 2 and leaf.shape[i] not in (2, 3):
      kinds[i] = FUSED_FEATURES
  return tuple(kinds)


def fused_parts_of_name(name: AxisName) -> Optional[int]:
  """How many projections a fused axis named ``name`` holds (``qkv``: 3, ``kv``: 2)."""
  names = name if isinstance(name, tuple) else (name,)
  return next((_FUSED_PARTS[n.lower()] for n in names
               if isinstance(n, str) and n.lower() in _FUSED_PARTS), None)


# ------------------------------------------------------------------ module names

_NORM = re.compile(r"norm|^ln(_\w+|\d+)?$")          # rms_norm, LayerNorm_0, ln_f, ln1 ...
_VECTOR_NAMES = ("bias", "scale")
WEIGHT_NAMES = ("kernel", "w", "weight", "weights")
BIAS_NAMES = ("bias", "b")
_STRONG_HEAD = ("lm_head", "head", "logits", "unembed", "unembedding")
# Names of an output head in one model and of something else in the next.
AMBIGUOUS_HEAD = ("out", "output", "decoder", "logitdense", "output_layer", "logit", "readout")
_BLOCK = re.compile(r"block|^(layers?|h|blocks?)(_?\d+)?$")
_EXPERTS = re.compile(r"expert|moe|^exp$")
_PROJ_AFFIX = re.compile(r"^(w_?|to_|attn_|self_attn_|c_)|(_?proj(ection)?|_einsum|_linear|_dense"
                         r"|_kernel|_weight|_layer)$")
PROJECTION_NAMES = {
    "query": ("q", "query", "wq", "queries"),
    "key": ("k", "key", "wk", "keys"),
    "value": ("v", "value", "wv", "values"),
    "out": ("o", "out", "wo", "output", "attn_out", "vec", "attn_vec", "out_proj", "dense"),
    "kv": ("kv", "wkv"),
    "qkv": ("qkv", "wqkv", "in", "attn", "c_attn"),
}
_QK_NORM = re.compile(r"^_?(q|query|k|key)_?(norm|ln|layernorm|rmsnorm)$")


def is_norm_name(name: str) -> bool:
  """A (lower-case) path component named like a norm: ``rms_norm``, ``layernorm_0``, ``ln_f``."""
  return bool(_NORM.search(name))


def is_qk_norm_name(name: str) -> bool:
  """A (lower-case) module name of a query or key norm: ``q_norm``, ``key_layernorm``."""
  return bool(_QK_NORM.match(name))


def is_block_name(name: str) -> bool:
  """A (lower-case) path component named like a repeated block: ``block``, ``layers_3``, ``h``."""
  return bool(_BLOCK.search(name))


def is_expert_name(name: str) -> bool:
  """A (lower-case) path component of a mixture of experts: ``experts``, ``moe``, ``exp``."""
  return bool(_EXPERTS.search(name))


def projection_name(component: str) -> Optional[str]:
  """``"query"``, ``"key"``, ``"value"``, ``"out"``, ``"kv"`` or ``"qkv"`` for a module name."""
  name = component.lower()
  for _ in range(3):
    for role, names in PROJECTION_NAMES.items():
      if name in names:
        return role
    stripped = _PROJ_AFFIX.sub("", name)
    if stripped == name or not stripped:
      break
    name = stripped
  return None


def is_vector_name(leaf: Leaf) -> bool:
  """A bias, a scale or anything under a norm: a vector, whatever its shape."""
  lower = leaf.lower
  return bool(lower) and (lower[-1] in _VECTOR_NAMES or any(is_norm_name(n) for n in lower))


def is_strong_head(name: str) -> bool:
  """A (lower-case) module name only an output head has: ``lm_head``, ``unembed``..."""
  return (name in _STRONG_HEAD or "unembed" in name
          or (name.endswith("head") and not name.endswith("multihead")))


def is_embedding_name(leaf: Leaf) -> bool:
  """A parameter named like an embedding table (``embed``, ``wte``, ``wpe``)."""
  joined = "/".join(leaf.lower)
  return (("embed" in joined and "emb_proj" not in joined)
          or any(n in ("wte", "wpe") for n in leaf.lower))


def is_positional(leaf: Leaf) -> bool:
  """A parameter named like a positional embedding (``pos_embedding``, ``wpe``)."""
  return any("pos" in n or n == "wpe" for n in leaf.lower)


# Projections whose fan-in is the model width (attention inputs, MLP up/gate) and whose fan-out is
# (attention and MLP outputs), by the names models give them. Only specific names: a generic
# "dense" or "output" is an input projection in one model and an output in the next.
_IN_NAMES = frozenset((
    "q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "q_proj", "k_proj", "v_proj",
    "query_proj", "key_proj", "value_proj", "qkv", "qkv_proj", "wqkv", "c_attn",
    "query_key_value", "kv", "kv_proj", "wkv", "in_proj", "c_fc", "fc1", "fc_in", "w1", "w3",
    "wi", "wi_0", "wi_1", "gate_proj", "up_proj", "gate", "up", "gate_up_proj", "gate_up",
    "dense_h_to_4h", "lin1"))
_OUT_NAMES = frozenset((
    "o", "o_proj", "out_proj", "wo", "c_proj", "attn_out", "output_proj", "fc2", "fc_out", "w2",
    "down_proj", "down", "dense_4h_to_h", "lin2"))
_GATE_UP_NAMES = frozenset(("gate_up_proj", "gate_up", "up_gate_proj", "up_gate", "w13", "w1_3"))


def component_name(leaf: Leaf) -> str:
  """The (lower-case) name of the module holding a kernel: ``q_proj`` for ``.../q_proj/kernel``."""
  lower = leaf.lower
  return lower[-2] if len(lower) >= 2 and lower[-1] in WEIGHT_NAMES else lower[-1]


def projection_path(leaf: Leaf) -> tuple[str, ...]:
  """The path of the module holding a kernel (the kernel's own path for a bare ``[D, F]``)."""
  return leaf.names[:-1] if leaf.lower[-1] in WEIGHT_NAMES else leaf.names


def io_side(leaf: Leaf) -> Optional[str]:
  """``"in"`` for a projection named like one whose fan-in is the model width, ``"out"`` for one
  whose fan-out is, None when the name does not say."""
  name = component_name(leaf)
  if name in _IN_NAMES:
    return "in"
  if name in _OUT_NAMES:
    return "out"
  return None


def fused_role(leaf: Leaf) -> Optional[str]:
  """``"qkv"``, ``"kv"`` or ``"gate_up"`` for a kernel named like a fused projection."""
  name = component_name(leaf)
  if name in _GATE_UP_NAMES:
    return "gate_up"
  role = projection_name(name)
  return role if role in ("qkv", "kv") else None
