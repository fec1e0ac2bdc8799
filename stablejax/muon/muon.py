"""Outlier-safe Muon: Newton-Schulz momentum orthogonalisation with statistical guards.

Muon (Jordan et al., https://github.com/KellerJordan/modded-nanogpt) updates each hidden weight
matrix with the (approximate) polar factor of its momentum, computed by Newton-Schulz (see
:mod:`stablejax.muon.newton_schulz`). Liu et al., "Muon is Scalable for LLM Training" (Moonlight,
arXiv 2502.16982) scale that update by ``0.2 * sqrt(max(fan_in, fan_out))`` so its RMS matches
AdamW's and add decoupled weight decay. Everything that is not a hidden matrix (embeddings, the
output head, norms, biases, scalars) goes to AdamW with its own learning rate
(:mod:`stablejax.muon.routing`, which also decides each matrix's layout, e.g. Flax attention
kernels ``[D, H, hd]`` as one ``[D, H*hd]`` matrix).

The "outlier-safe" layer adds, per Muon matrix and per step, all on device:

* **Outlier clamping** before NS (:mod:`stablejax.muon.outliers`): entries of the momentum
  matrix that are statistical outliers (z-score or inter-quartile range) are clamped back to the
  boundary, so one exploding entry cannot take over the Frobenius normalisation and flatten
  every other direction of the update. The matrix keeps its shape and every other entry.
* **NS health check** after NS (:mod:`stablejax.muon.direction`): a non-finite result, or one
  whose Frobenius norm is outside what NS can produce, is replaced by the Frobenius-normalised
  momentum (the "emergency fallback"; zero if the momentum itself is non-finite). A near-zero
  momentum gives the small update NS computes for it, as in optax, and is not counted as an
  instability.
* **Non-finite gradients** (in every group, Muon and AdamW alike): a tensor whose gradient, new
  optimizer state or update is not finite gets a zero update for that step and keeps its
  optimizer state (momentum, Adam moments), so one NaN cannot freeze the matrix for good
  (:mod:`stablejax.transforms.nonfinite_tensors`). The other tensors update normally; shared
  step counts advance. Counted as
  ``muon/nonfinite_count`` / ``muon/nonfinite_rate``.
* **Counters and rates** in :class:`OutlierSafeMuonState` and :class:`GroupUpdateRmsState`,
  exposed by :func:`stablejax.stability_metrics` as ``muon/outlier_rate``,
  ``muon/ns_instability_rate``, ``muon/fallback_rate``, ``muon/outlier_count``,
  ``muon/fallback_count``, ``muon/nonfinite_count``, ``muon/nonfinite_rate`` and
  ``muon/update_rms/<group>``.
"""

from __future__ import annotations

import numbers
from typing import Any, Hashable, NamedTuple, Optional, cast

import jax
import jax.numpy as jnp
import optax

from stablejax.layout.analysis import param_leaves
from stablejax.muon import newton_schulz as _ns
from stablejax.muon import normuon as _normuon
from stablejax.muon import routing
from stablejax.muon.labels import GROUPS
from stablejax.muon.notes import warn_notes
from stablejax.muon.direction import OutlierSafeMuonState as _OutlierSafeMuonState
from stablejax.muon.direction import muon_direction as _muon_direction
from stablejax.muon.direction import validate_muon_args as _validate_muon_args
from stablejax.transforms._common import saturating_add as _saturating_add
from stablejax.transforms._common import sum_of_scalars
from stablejax.transforms.metrics import Rate, Series, register_state_metrics
from stablejax.transforms.nonfinite_tensors import TensorGuardState as _TensorGuardState
from stablejax.transforms.nonfinite_tensors import skip_nonfinite_tensors as _skip_nonfinite_tensors



class GroupUpdateRmsState(NamedTuple):
  """Wrapper state of :func:`outlier_safe_muon`: the routed inner state and per-group numbers.

  Attributes:
    inner_state: the ``optax.partition`` state of the four groups (each group's state wrapped
      in a :class:`TensorGuardState`).
    muon, adam, embedding, head: float32 RMS of the final update (after learning rate and
      weight decay) applied to that group at the last step; 0 for an empty group.

  Example:
    >>> import jax, jax.numpy as jnp, stablejax
    >>> params = {"w": jnp.full((8, 16), 0.1), "b": jnp.zeros((16,))}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=1e-3)
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 16)), "b": jnp.ones((16,))}
    >>> updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    >>> rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x))))
    >>> bool(jnp.isclose(state.muon, rms(updates["w"])))
    True
    >>> # Adam's first step has the size of its learning rate; there is no embedding here
    >>> round(float(state.adam), 6), float(state.embedding)
    (0.001, 0.0)
  """
  inner_state: optax.OptState
  muon: jax.Array
  adam: jax.Array
  embedding: jax.Array
  head: jax.Array


def _group_rms(updates: optax.Updates, labels: list[str]) -> dict[str, jax.Array]:
  squares: dict = {g: [] for g in GROUPS}
  counts = {g: 0 for g in GROUPS}
  for u, label in zip(jax.tree.leaves(updates), labels):
    uf = u.astype(jnp.float32)
    squares[label].append(jnp.sum(uf * uf))
    counts[label] += u.size
  return {g: jnp.sqrt(sum_of_scalars(squares[g]) / max(counts[g], 1)) for g in GROUPS}


def _is_zero(value: object) -> bool:
  return isinstance(value, numbers.Number) and value == 0


def _check_same_parameters(updates: optax.Updates, params: optax.Params) -> None:
  got, _ = param_leaves(updates)
  want, _ = param_leaves(params)
  for u, p in zip(got, want):
    if (u.names, u.shape) != (p.names, p.shape):
      raise ValueError(f"outlier_safe_muon.update: the updates hold {u.path} {u.shape} where the "
                       f"params hold {p.path} {p.shape}; pass updates and params with the same "
                       "structure as the params given to init")
  if len(got) != len(want):
    raise ValueError(f"outlier_safe_muon.update: {len(got)} updates for {len(want)} params; pass "
                     "updates and params with the same structure as the params given to init")


def _check_label_values(param_labels: routing.LabelsOrFn) -> None:
  """A mapping or a label tree names known groups only (a callable is checked at init)."""
  if isinstance(param_labels, dict) or not (param_labels is None or callable(param_labels)):
    bad = sorted({str(lab) for lab in jax.tree.leaves(param_labels) if lab not in GROUPS})
    if bad:
      raise ValueError(f"param_labels contains unknown group(s) {bad}; use labels from "
                       f"{GROUPS}")


def _group_learning_rates(learning_rate: optax.ScalarOrSchedule,
                          adam: Optional[optax.ScalarOrSchedule],
                          embedding: Optional[optax.ScalarOrSchedule],
                          head: Optional[optax.ScalarOrSchedule],
                          consistent_rms: Optional[float]
                          ) -> tuple[dict[str, optax.ScalarOrSchedule], dict[str, str]]:
  """Each group's learning rate, and the name of the argument it came from (the defaults of
  :func:`outlier_safe_muon`: the AdamW rate is Muon's with Moonlight's scale, the embedding and
  head rates are the AdamW rate)."""
  sources = {"muon": "learning_rate", "adam": "adam_learning_rate",
             "embedding": "embedding_learning_rate", "head": "head_learning_rate"}
  if adam is None:
    if consistent_rms is None:
      raise ValueError("adam_learning_rate is required when consistent_rms=None (Muon's width "
                       "scaling uses rates ~0.02, too large for AdamW); pass e.g. 3e-4")
    adam = learning_rate
    sources["adam"] = "learning_rate"
  if embedding is None:
    embedding = adam
    sources["embedding"] = sources["adam"]
  if head is None:
    head = adam
    sources["head"] = sources["adam"]
  rates = {"muon": learning_rate, "adam": adam, "embedding": embedding, "head": head}
  return rates, sources


def _momentum_tree(group_state: optax.OptState) -> optax.Params:
  """The per-parameter momentum of one group's state: the params' structure, with
  ``optax.MaskedNode`` where a parameter is not the group's."""
  def holds_momentum(x: object) -> bool:
    return isinstance(x, (_OutlierSafeMuonState, optax.ScaleByAdamState))
  return next(x for x in jax.tree.leaves(group_state, is_leaf=holds_momentum)
              if holds_momentum(x)).mu


def recorded_labels(partition_state: optax.OptState, tree: optax.Params) -> optax.Params:
  """The group of every parameter of ``tree``, as the state of :func:`outlier_safe_muon` records
  it: the group whose masked state holds the parameter (``optax.MaskedNode`` where none does,
  as for the parameters an enclosing ``optax.masked`` leaves out).

  Raises:
    ValueError: ``tree`` has other parameters than the state was initialised with.
  """
  leaves, treedef = param_leaves(tree)
  labels: list = [optax.MaskedNode()] * len(leaves)
  inner_states = cast(optax.transforms.PartitionState, partition_state).inner_states
  for group, group_state in inner_states.items():
    try:
      held = treedef.flatten_up_to(_momentum_tree(group_state))
    except (ValueError, TypeError) as e:
      raise ValueError(
          "outlier_safe_muon: the parameters of this update differ from the ones its state "
          "was initialised with; pass update() the same parameter tree (same paths and shapes) "
          f"as init() ({e})") from None
    for i, x in enumerate(held):
      if not isinstance(x, optax.MaskedNode):
        labels[i] = group
  return treedef.unflatten(labels)


def _partition(groups: dict[Hashable, optax.GradientTransformation],
               labels: optax.Params) -> optax.GradientTransformationExtraArgs:
  """``optax.partition`` of ``groups`` by the label tree ``labels``; given as a function, since
  optax calls a callable label tree (an Equinox module is one)."""
  return optax.partition(groups, lambda _: labels)


def _count_skipped_tensors(inner_state: optax.OptState, n_tensors: int) -> optax.OptState:
  """The Muon counters with every group's tensors skipped as non-finite at this step."""
  def is_guard(x: object) -> bool:
    return isinstance(x, _TensorGuardState)
  guards = [s for s in jax.tree.leaves(inner_state, is_leaf=is_guard) if is_guard(s)]
  skipped = sum((s.skipped for s in guards), jnp.zeros((), jnp.int32))

  def count(node: object) -> object:
    if not isinstance(node, _OutlierSafeMuonState):
      return node
    return node._replace(nonfinite_count=_saturating_add(node.nonfinite_count, skipped),
                         nonfinite_rate=skipped.astype(jnp.float32) / max(1, n_tensors))

  return jax.tree.map(count, inner_state,
                      is_leaf=lambda x: isinstance(x, _OutlierSafeMuonState))


def outlier_safe_muon(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: Optional[int] = None,
    ns_coeffs: _ns.CoeffsSpec = "standard",
    weight_decay: float = 0.0,
    consistent_rms: Optional[float] = 0.2,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    embedding_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    head_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    outlier_threshold: float = 5.0,
    outlier_method: Optional[str] = "zscore",
    ns_backend: str = "auto",
    param_labels: routing.LabelsOrFn = None,
    weight_dimension_numbers: routing.DimensionNumbersOrFn = None,
    strict_overrides: bool = False,
    ns_method: str = "standard",
    ns_preconditioning: str = "frobenius",
    per_head: bool = False,
    num_heads: Optional[int] = None,
    normuon: bool = False,
    normuon_b2: float = 0.95,
) -> optax.GradientTransformationExtraArgs:
  """Muon for hidden matrices, AdamW for embeddings, head, norms and biases, with safety guards.

  Routing (see :func:`stablejax.label_params`, printable with :func:`stablejax.describe_routing`):
  hidden matrices -> Muon at ``learning_rate``; embeddings -> AdamW at
  ``embedding_learning_rate``; output head -> AdamW at ``head_learning_rate``; norm gains, biases
  and scalars -> Adam at ``adam_learning_rate``, never weight decayed. Labels are a function of
  each parameter's path and shape only, so ``init`` and ``update`` agree however the tree is
  wrapped (Linen params, ``FrozenDict``, ``nnx.State`` with ``Variable``s at ``init`` and pure
  arrays at ``update`` as ``nnx.Optimizer`` does); an update tree with other parameters than
  ``init`` saw is a clear error.

  Nothing is kept outside the optimizer state, as in optax: ``init`` routes the tree it is
  given (reading Flax metadata where ``nnx.Optimizer`` still passes it) and its state records
  each parameter's group (the group whose masked state holds it), which ``update`` reads back;
  Muon's matrix layouts are read from the tree ``update`` is given (a layout that only
  metadata decides warns at ``init``: pass ``weight_dimension_numbers``). The routing arguments
  travel with the transform, where :func:`stablejax.describe_routing` finds them in any chain.

  Muon branch, per matrix: Nesterov momentum, outlier clamp of the NS input, Newton-Schulz,
  health check with emergency fallback, scale by ``consistent_rms * sqrt(max(fan_in, fan_out))``
  (Moonlight, arXiv 2502.16982) or ``sqrt(max(1, fan_out / fan_in))`` when ``consistent_rms`` is
  None, decoupled weight decay ``weight_decay * lr * param``, then ``-lr``. The matrix of each
  leaf: see ``weight_dimension_numbers``.

  Every group: a tensor whose gradient (or new state, or update) is not finite gets a zero
  update and keeps its optimizer state for that step (``muon/nonfinite_count``); wrap the chain
  in :func:`stablejax.skip_nonfinite` to skip the whole step instead.

  Compared with ``optax.contrib.muon(..., consistent_rms=..., eps=1e-8)``: with
  ``outlier_method=None`` and the same dimension numbers the Muon branch produces the same
  updates (same bias-corrected Nesterov momentum, NS, scale and decay; only the ``"auto"`` NS
  backend may differ in rounding on GPU/TPU). Intended differences: optax routes by
  ``ndim == 2`` only (embeddings and the head go to Muon, other layouts need explicit dimension
  numbers) while this routes by role and recognises Flax attention and scan-stacked layouts;
  optax's AdamW branch uses Nesterov and one learning rate, while here the AdamW groups are plain
  ``optax.adamw`` with three learning rates, and norm gains and biases are never decayed.

  Learning-rate defaults: ``adam_learning_rate=None`` uses ``learning_rate`` when
  ``consistent_rms`` is set (the Moonlight scale matches AdamW's update RMS, so one rate serves
  both); with ``consistent_rms=None`` Muon rates (~0.02) are far too large for AdamW, so
  ``adam_learning_rate`` is then required. ``embedding_learning_rate`` and
  ``head_learning_rate`` default to ``adam_learning_rate``. Every rate may be an optax schedule,
  and every float hyperparameter may be injected with
  ``optax.inject_hyperparams(stablejax.outlier_safe_muon)(learning_rate=...)``: ``ns_steps``
  (a loop count) stays static at its default; an explicit ``ns_steps`` (or ``num_heads``) needs
  ``static_args=("ns_steps",)`` there (add ``"param_labels"`` / ``"weight_dimension_numbers"``
  when passing callables, which ``inject_hyperparams`` would take for schedules).

  Every argument after ``momentum`` is keyword-only.

  Args:
    learning_rate: Muon learning rate (float or schedule).
    momentum: Muon momentum (EMA decay).
    nesterov: Nesterov momentum for Muon.
    ns_steps: Newton-Schulz iterations (a Python int); None: 5.
    ns_coeffs: "standard", "polar_express", a triple or per-step triples.
    weight_decay: decoupled weight decay for Muon matrices (multiplied by the learning rate).
    consistent_rms: Moonlight RMS factor (0.2) or None for width scaling.
    adam_learning_rate: Adam rate for norm gains, biases, scalars (group "adam").
    embedding_learning_rate: AdamW rate for embeddings.
    head_learning_rate: AdamW rate for the output head.
    adam_b1, adam_b2, adam_eps: AdamW hyperparameters.
    adam_weight_decay: AdamW decoupled weight decay of the "embedding" and "head" groups (the
      "adam" group, norm gains, biases and scalars, is never decayed).
    outlier_threshold: z threshold for "zscore"; ``2 k`` for "iqr".
    outlier_method: "zscore", "iqr" or None (no clamping).
    ns_backend: "auto", "xla" or "pallas".
    param_labels: None (the default rule of :func:`stablejax.label_params`); a mapping
      ``{path pattern: group}`` applied on top of it (``{"params/Dense_3": "head"}``: fnmatch
      globs or path prefixes on ``/``-joined paths); a full label pytree (or a prefix of one);
      or a callable ``params -> labels``. Groups: "muon", "adam" (never decayed), "embedding",
      "head".
    weight_dimension_numbers: which axes of each Muon leaf form its matrix, exactly as
      ``optax.contrib.muon`` takes them: a tree (or a prefix of one) of
      ``optax.contrib.MuonDimensionNumbers``, or a callable ``params -> tree``. A None entry
      keeps the default layout (routing is ``param_labels``' job here, so unlike optax a None
      does not move the leaf to AdamW). :func:`stablejax.muon_dimension_numbers` returns the
      default tree and takes per-leaf overrides. Without it, Flax attention kernels are one
      ``[D, H*hd]`` / ``[H*hd, D]`` matrix, other leaves their last two axes, and a leaf of 3+
      axes that no rule recognises gets a warning at init naming it and this fix.
    strict_overrides: a ``param_labels`` pattern that matches no parameter is an error (by
      default it warns once at ``init``, so one mapping can serve several variants of a model).
    ns_method: "standard" or "gram" (Gram Newton-Schulz where it takes fewer FLOPs, see
      :func:`stablejax.newton_schulz`).
    ns_preconditioning: "frobenius" or "aol" (Turbo-Muon; use it with one step fewer).
    per_head: orthogonalise attention projections per head: query, key and value per head
      (grouped-query key and value per key head; a fused query/key/value kernel per head of each
      part), the output projection per head (:func:`stablejax.layout.heads.per_head_layouts`),
      in every layout the routing recognises; given ``weight_dimension_numbers`` win. With
      ``consistent_rms`` the update RMS is unchanged; with width scaling the output projection's
      per-head ``[hd, D]`` matrices get ``sqrt(D / hd)``.
    num_heads: the query head count, needed by ``per_head`` for attention layers of 2-D kernels
      without a query/key norm (a clear error at ``init`` names it when missing).
    normuon: NorMuon (arXiv 2510.05491): after orthogonalisation, each output neuron of each
      matrix divided by the root of an EMA of its mean square, the matrix's Frobenius norm kept
      (:mod:`stablejax.muon.normuon`; its :class:`~stablejax.muon.normuon.NorMuonState` sits in
      the Muon group's chain state).
    normuon_b2: that EMA's decay.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is :class:`GroupUpdateRmsState`
    around an ``optax.partition`` state whose Muon branch holds :class:`OutlierSafeMuonState`.
    ``update`` needs ``params`` (weight decay).

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_ (2024) and modded-nanogpt; Liu et al.,
    `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_ (arXiv 2502.16982),
    the ``0.2 * sqrt(max(fan_in, fan_out))`` scale and decoupled weight decay; Loshchilov and
    Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_
    (arXiv 1711.05101), the AdamW groups.

  Example:
    >>> import jax, jax.numpy as jnp, optax, stablejax
    >>> params = {"embed": jnp.zeros((32, 8)), "w": jnp.ones((8, 8)), "b": jnp.zeros(8)}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=2e-3, adam_learning_rate=1.5e-3)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> sorted(stablejax.stability_metrics(state))[:2]
    ['muon/fallback_count', 'muon/fallback_rate']
  """
  ns_steps = _validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend)
  _ns.resolve_iteration(ns_coeffs, ns_steps, ns_method, ns_preconditioning)  # validates early
  if not isinstance(normuon, bool):
    raise ValueError(f"normuon must be True or False, got {normuon!r}")
  _check_label_values(param_labels)
  rates, rate_sources = _group_learning_rates(learning_rate, adam_learning_rate,
                                              embedding_learning_rate, head_learning_rate,
                                              consistent_rms)
  # What decides the routing, besides the tree: describe_routing finds it in any chain.
  info = routing.RoutingInfo(param_labels, weight_dimension_numbers, rates, rate_sources,
                             routing.per_head_of(per_head, num_heads))

  def groups(muon_layouts: list[routing.Dims]
             ) -> dict[Hashable, optax.GradientTransformation]:
    """The four groups' transforms, each guarded per tensor; the Muon branch orthogonalises
    ``muon_layouts``, one per Muon leaf in order."""
    def layouts_of(tree: optax.Params) -> list[routing.Dims]:
      del tree  # the Muon branch sees its masked view of the params: its layouts are given
      return muon_layouts
    muon_parts = [
        _muon_direction(momentum, nesterov, ns_steps, ns_coeffs, consistent_rms,
                        outlier_threshold, outlier_method, ns_backend, 1e-8, layouts_of,
                        ns_method, ns_preconditioning),
    ]
    if normuon:
      muon_parts.append(_normuon.with_layouts(normuon_b2, 1e-8, layouts_of))
    if not _is_zero(weight_decay):
      muon_parts.append(optax.add_decayed_weights(weight_decay))
    muon_parts.append(optax.scale_by_learning_rate(learning_rate))

    def adamw(lr: optax.ScalarOrSchedule, decay: float) -> optax.GradientTransformation:
      return optax.adamw(lr, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=decay)

    # "adam" holds exactly norm gains, biases and scalars: never decayed, whatever their rank.
    transforms = {
        "muon": optax.chain(*muon_parts),
        "adam": optax.adam(rates["adam"], b1=adam_b1, b2=adam_b2, eps=adam_eps),
        "embedding": adamw(rates["embedding"], adam_weight_decay),
        "head": adamw(rates["head"], adam_weight_decay),
    }
    return {g: _skip_nonfinite_tensors(t) for g, t in transforms.items()}

  def init_fn(params: optax.Params) -> GroupUpdateRmsState:
    # Routed here, where nnx.Optimizer passes Variables that still carry their metadata; the
    # state records each parameter's group (its group's masked state holds it), so update
    # reads the groups back from the state, whatever wrapping its pure arrays come in.
    found = routing.plan(params, info.param_labels, info.weight_dimension_numbers,
                         strict_overrides, info.per_head)
    notes = found.notes + routing.metadata_layout_notes(
        params, found, info.weight_dimension_numbers, info.per_head)
    # Issued from one place, so Python's warning registry shows each once however often init is
    # traced (eval_shape, jit, a rollback); describe_routing's silenced trace does not count.
    warn_notes(notes, "outlier_safe_muon", stacklevel=1)
    partition = _partition(groups(found.muon_layouts()), found.label_tree())
    zero = jnp.zeros((), jnp.float32)
    return GroupUpdateRmsState(partition.init(params), zero, zero, zero, zero)

  def update_fn(updates: optax.Updates, state: GroupUpdateRmsState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, GroupUpdateRmsState]:
    if params is not None:
      _check_same_parameters(updates, params)
    labels = recorded_labels(state.inner_state, updates)
    layouts = routing.muon_layouts(updates, labels, info.weight_dimension_numbers,
                                   info.per_head)
    partition = _partition(groups(layouts), labels)
    new_updates, inner_state = partition.update(updates, state.inner_state, params, **extra_args)
    label_list = jax.tree.leaves(labels)
    inner_state = _count_skipped_tensors(inner_state, len(label_list))
    return new_updates, GroupUpdateRmsState(inner_state, **_group_rms(new_updates, label_list))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _muon_metrics(s: _OutlierSafeMuonState) -> dict:
  return {
      "outlier_rate": s.outlier_rate,
      "ns_instability_rate": s.ns_instability_rate,
      "fallback_rate": s.fallback_rate,
      "outlier_count": s.outlier_count,
      "fallback_count": s.fallback_count,
      "nonfinite_count": s.nonfinite_count,
      "nonfinite_rate": s.nonfinite_rate,
  }


def _group_rms_metrics(s: GroupUpdateRmsState) -> dict:
  return {g: getattr(s, g) for g in GROUPS}


register_state_metrics(
    _OutlierSafeMuonState, "muon", _muon_metrics,
    rates=(Rate("muon_outlier_rate", flag="outlier_rate", label="Muon outlier rate", budget=0.05,
                advice="Muon outlier rate {value:.3g} > 0.05: lower the Muon learning rate or "
                       "check the data for pathological batches"),
           Rate("muon_ns_instability_rate", flag="ns_instability_rate",
                label="NS instability rate", budget=0.05,
                advice="Newton-Schulz instability rate {value:.3g} > 0.05: use fewer NS steps "
                       "(e.g. 5 -> 3) or run NS in float32"),
           Rate("muon_fallback_rate", flag="fallback_rate", counter="fallback_count",
                label="Muon fallbacks / step", budget=0.01, tensors=True,
                advice="Muon emergency fallbacks {value:.3g} per step > 0.01: lower the Muon "
                       "learning rate")), order=90)
register_state_metrics(GroupUpdateRmsState, "muon/update_rms", _group_rms_metrics,
                       series=(Series("*", "*", "update_rms"),), order=91)
