"""PawQwen3 (Elastic Attention, seed 000): Qwen3 whose prefill picks a mode per request and KV head.

Each attention layer carries a small router (`attn.elastic.AttentionRouter`). At prefill it reads
the keys after `k_norm` and before RoPE, pools them per request (`ctx_q_pool`: mean of the first
and last 100 valid keys), and decides per KV head: `z = 1` retrieval (mode `retrieval_mode`),
`z = 0` sparse (mode `toggle_type`). `derive_head_mask_type` turns `z [B, K]` into Block-Sparse-
Attention codes `[B, N]` (0 full, 1 XAttention block-sparse, -1 streaming) and
`elastic_prefill_attention` runs the XAttention estimate and the block-sparse attention:

    qkv = layer.project(x, positions)       # ElasticQKV: q, k, v after RoPE, k_pre, route
    o, z = ElasticAttend()(spec, qkv, None)  # pool k_pre -> route -> modes -> block-sparse
    y = layer.output(o, qkv)

The router runs inside the attend (`ElasticQKV.route` is the layer's router as a function of the
pooled keys), so an engine attend can pool over the whole prompt (chunked prefill) and reuse the
routing and the elastic attention. `DenseAttend` and the engine's `PagedAttend` read only
q / k / v and give the dense backbone (the FD integration keeps decode dense as well).
`enable_ada_sparsity=False` replaces the router by static per-layer decisions from
`attn_mask_log_alphas` (`static_decisions`). Both decisions are hard: differentiating the elastic
forward raises a `TypeError` (`attn.elastic.router.hard_decision`); routers are trained through
a relaxation (`models.heads.router`), the backbone through `elastic=False`.

HF layout (LCM-Lab `PawQwen3ForCausalLM`, `architectures: ["PawQwen3ForCausalLM"]`): Qwen3's
tensors plus, per layer `i`, under `model.layers.{i}.self_attn.`:

| HF name | shape | here |
|---|---|---|
| `mask_allocator.cls_feat_extractor.{0,2}.{weight,bias}` | `[4d, d]`, `[d, 4d]` | `mixer.router` |
| `mask_allocator.cls_router_head_agnostic.{0,2,4}.{weight,bias}` | `..., [2, d]` | `mixer.router` |
| `attn_mask_log_alphas` | `[K]` | `mixer.attn_mask_log_alphas` |
| `mask_allocator.log_temp`, `mask_allocator.task_embedding.weight` | | ignored (training) |

and the training-only Lagrange multipliers `model.sparsity_lambda_{1,2}` /
`model.sparsity_lambda{1,2}_task` (ignored). `d = head_dim`; Linear weights are transposed
(`[out, in]` -> `[in, out]`). With `use_softmax=False` (HF's default) the router is the
sigmoid variant (one logit, a LayerNorm), which is not implemented: its tensors are ignored and
`enable_ada_sparsity` must be False.

Config defaults. When `config.json` omits an elastic field we take HF `PawQwen3Config`'s default
(the class the checkpoints were trained and evaluated with), not FastDeploy's. They disagree:

| field | here (= HF) | FD |
|---|---|---|
| `local_window_size` | 1024 | 2048 |
| `toggle_type` | `"streaming"` | `"xattn"` |
| `enable_ada_sparsity` | False | True |
| `pooling_mode` | `"first_token"` | `"ctx_q"` |
| `use_softmax` | False | True |
| `xattn_threshold` | 0.8 | 0.9 |

`xattn_threshold`, `xattn_stride`, `xattn_norm`: HF's eval code ignores the config and hard-codes
16 / 0.8 / 1; FD reads the config (default 0.9, the paper's τ). We read the config value when it is
present (so a checkpoint saying 0.9 runs at 0.9, unlike HF) and use HF's effective 0.8 when it is
absent. `block_size` (the XAttention / BSA block) must be 128, Block-Sparse-Attention's fixed tile
grid; `sink_blocks = ceil(sink_size / block_size)`, `local_blocks = ceil(local_window_size /
block_size)` (HF divides by 128 whatever `block_size` says: the same numbers at 128). Smaller
powers of two exist only for tests, through `testing_small_blocks=True` (`config.json` key
`longctx_testing_small_blocks`, which no real checkpoint has).

Not done here: the sigmoid router, packed segments (`segment_ids`) under elastic attention, sliding
window layers, task embeddings. Training (Gumbel noise, temperature, sparsity targets) lives in
`models.heads.router`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from attn._checks import concrete
from attn.elastic import (
    AttentionRouter,
    ctx_q_pool,
    derive_head_mask_type,
    elastic_prefill_attention,
)
from attn.elastic.reference import KNOWN_MODES, MODE_CODES, SUPPORTED_PAIRS
from attn.elastic.router import HF_LINEARS, hard_decision
from models.config import ConfigError, HFConfig, check_choice, check_positive
from models.convert.mapping import linear, param
from models.convert.registry import Family, register
from models.families.llama import ignore as _llama_ignore
from models.families.qwen3 import Qwen3ForCausalLM
from models.families.qwen3 import config_from_hf as _qwen3_config_from_hf
from models.layers.attention import AttendSpec, Attention
from models.layers.linear import weight
from models.layers.rope import rotate
from models.transformer import DecoderConfig, decoder_rules

# HF `PawQwen3Config` defaults, used for fields a checkpoint omits (see the module docstring).
HF_DEFAULTS = {
    "local_window_size": 1024,
    "sink_size": 128,
    "toggle_type": "streaming",
    "retrieval_mode": "full",
    "enable_ada_sparsity": False,
    "pooling_mode": "first_token",
    "use_softmax": False,
    "xattn_stride": 16,
    "xattn_threshold": 0.8,  # HF's hard-coded value; FD and the paper use 0.9
    "xattn_norm": 1.0,
    "block_size": 128,
}
# Training-only `config.json` keys; inference ignores them (listed for readers and tests).
TRAINING_ONLY_KEYS = (
    "enable_lambda_task", "enable_layerwise_sparsity", "layerwise_sparsity_schedule",
    "layerwise_sparsity_min_ratio", "layerwise_sparsity_max_ratio", "layerwise_sparsity_power",
    "layerwise_sparsity_weight", "erank_analysis_path", "suggested_sparsity",
    "suggested_threshold", "topk_k", "triangle_n_last", "use_task_emb_for_mask", "pooling_seq",
    "max_window_layers", "disable_linear_regularization_term",
)
POOLING_MODES = ("ctx_q", "first_token")
BSA_BLOCK_SIZE = 128
POOL_BOUNDARY = 100  # keys pooled at each end of a request (ctx_q_pool)

# Hard-concrete gate constants (Louizos et al. 2018, as in the HF L0 utilities).
_LIMIT_LEFT, _LIMIT_RIGHT, _BETA, _EPS = -0.1, 1.1, 2.0 / 3.0, 1e-6


def _is_real(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PawQwen3Config(DecoderConfig):
    """Qwen3 decoder plus the elastic-attention fields of `config.json` (seed spec §1.2).

    Attributes:
      local_window_size: streaming heads' local window in tokens.
      sink_size: streaming heads' sink in tokens.
      toggle_type: mode of sparse heads (z = 0): `"xattn"`, `"streaming"` or `"full"`.
      retrieval_mode: mode of retrieval heads (z = 1): `"full"` or `"xattn"`.
      enable_ada_sparsity: True: the router decides per request; False: static decisions from
        `attn_mask_log_alphas`.
      pooling_mode: router pooling; only `"ctx_q"` (boundary pooling) runs the router.
      use_softmax: router with two logits + argmax (True, implemented) or the sigmoid variant.
      xattn_stride, xattn_threshold, xattn_norm: XAttention estimate parameters.
      block_size: XAttention / block-sparse block; 128 (BSA parity) unless `testing_small_blocks`.
      testing_small_blocks: allow smaller power-of-two blocks (tests only).

    Every `(retrieval_mode, toggle_type)` pair must be one `attn.elastic.derive_head_mask_type`
    supports. Sliding-window layers are refused.
    """

    local_window_size: int = HF_DEFAULTS["local_window_size"]
    sink_size: int = HF_DEFAULTS["sink_size"]
    toggle_type: str = HF_DEFAULTS["toggle_type"]
    retrieval_mode: str = HF_DEFAULTS["retrieval_mode"]
    enable_ada_sparsity: bool = HF_DEFAULTS["enable_ada_sparsity"]
    pooling_mode: str = HF_DEFAULTS["pooling_mode"]
    use_softmax: bool = HF_DEFAULTS["use_softmax"]
    xattn_stride: int = HF_DEFAULTS["xattn_stride"]
    xattn_threshold: float = HF_DEFAULTS["xattn_threshold"]
    xattn_norm: float = HF_DEFAULTS["xattn_norm"]
    block_size: int = HF_DEFAULTS["block_size"]
    testing_small_blocks: bool = False

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_choice(name, "toggle_type", self.toggle_type, KNOWN_MODES)
        check_choice(name, "retrieval_mode", self.retrieval_mode, KNOWN_MODES)
        pair = (self.retrieval_mode, self.toggle_type)
        if pair not in SUPPORTED_PAIRS:
            raise ConfigError(f"{name}.(retrieval_mode, toggle_type)={pair} is not supported; "
                              f"supported pairs: {SUPPORTED_PAIRS}")
        check_choice(name, "pooling_mode", self.pooling_mode, POOLING_MODES)
        for field in ("enable_ada_sparsity", "use_softmax", "testing_small_blocks"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"{name}.{field}={getattr(self, field)!r} must be a bool")
        if self.enable_ada_sparsity and self.pooling_mode != "ctx_q":
            raise ConfigError(f"{name}.pooling_mode={self.pooling_mode!r} must be 'ctx_q' with "
                              "enable_ada_sparsity=True (the only pooling inference implements)")
        if self.enable_ada_sparsity and not self.use_softmax:
            raise ConfigError(f"{name}.use_softmax=False (the sigmoid router) is not implemented; "
                              "enable_ada_sparsity=True needs use_softmax=True")
        check_positive(name, local_window_size=self.local_window_size,
                       xattn_stride=self.xattn_stride, block_size=self.block_size)
        if not isinstance(self.sink_size, int) or isinstance(self.sink_size, bool) \
                or self.sink_size < 0:
            raise ConfigError(f"{name}.sink_size={self.sink_size!r} must be an int >= 0")
        if self.testing_small_blocks:
            if self.block_size & (self.block_size - 1) or self.block_size > BSA_BLOCK_SIZE:
                raise ConfigError(f"{name}.block_size={self.block_size} must be a power of two "
                                  f"<= {BSA_BLOCK_SIZE}")
        elif self.block_size != BSA_BLOCK_SIZE:
            raise ConfigError(
                f"{name}.block_size={self.block_size} must be {BSA_BLOCK_SIZE} (Block-Sparse-"
                "Attention's tile grid); smaller powers of two only with testing_small_blocks=True")
        if self.block_size % self.xattn_stride:
            raise ConfigError(f"{name}.block_size={self.block_size} must be divisible by "
                              f"{name}.xattn_stride={self.xattn_stride}")
        if not _is_real(self.xattn_threshold) or not 0.0 < self.xattn_threshold <= 1.0:
            raise ConfigError(f"{name}.xattn_threshold={self.xattn_threshold!r} must be a float "
                              "in (0, 1]")
        if not _is_real(self.xattn_norm) or not self.xattn_norm > 0:
            raise ConfigError(f"{name}.xattn_norm={self.xattn_norm!r} must be a positive float")
        if "sliding_attention" in self.layer_types:
            raise ConfigError(f"{name}.layer_types={self.layer_types} has sliding layers; elastic "
                              "attention does not combine with a sliding window")

    @property
    def sink_blocks(self) -> int:
        """`ceil(sink_size / block_size)` (1 for the seed's 128 / 128)."""
        return math.ceil(self.sink_size / self.block_size)

    @property
    def local_blocks(self) -> int:
        """`ceil(local_window_size / block_size)` (16 for 2048 / 128), diagonal included."""
        return math.ceil(self.local_window_size / self.block_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticAttendSpec(AttendSpec):
    """`AttendSpec` plus the static elastic settings of a layer.

    Attributes:
      retrieval_mode, toggle_type: the mode names of z = 1 / z = 0 heads.
      group_size: G = N // K.
      block_size, stride, threshold, norm: XAttention / block-sparse parameters.
      sink_blocks, local_blocks: streaming geometry in blocks.
    """

    retrieval_mode: str
    toggle_type: str
    group_size: int
    block_size: int
    stride: int
    threshold: float
    norm: float
    sink_blocks: int
    local_blocks: int

    @property
    def uses_xattn(self) -> bool:
        """Whether some head can be in mode 1 (then the XAttention estimate runs)."""
        return MODE_CODES["xattn"] in (MODE_CODES[self.retrieval_mode],
                                       MODE_CODES[self.toggle_type])


class ElasticQKV(NamedTuple):
    """`PawQwen3Attention.project`'s output: `QKV`'s fields first, plus what routing needs.

    Attributes:
      q: `[B, T, N, H]` rotated queries.
      k: `[B, T, K, H]` rotated keys.
      v: `[B, T, K, Hv]` values.
      gate: always None (kept so the first four fields are `QKV`'s).
      k_pre: `[B, T, K, H]` keys after k_norm, before RoPE (the router's input).
      route: `pooled [B, K, H] -> z [B, K] int32` (1 = retrieval): the layer's router, or its
        static decisions broadcast when `enable_ada_sparsity=False`.
    """

    q: Float[Array, "B T N H"]
    k: Float[Array, "B T K H"]
    v: Float[Array, "B T K Hv"]
    gate: None
    k_pre: Float[Array, "B T K H"]
    route: Callable[[Array], Array]


@dataclasses.dataclass(frozen=True)
class ElasticAttend:
    """Full-forward elastic prefill: route each request, then block-sparse attention; no cache.

    Per layer: `pooled = ctx_q_pool(k_pre, lengths)`, `z = route(pooled)`, `modes =
    derive_head_mask_type(z, retrieval_mode, toggle_type, G)`, then `elastic_prefill_attention`
    (or `block_sparse_attention` without the estimate when no mode is XAttention). The returned
    "state" is the layer's decision `z [B, K]` int32, which `CausalLM.forward` collects.

    Args:
      lengths: optional `[B]` int32 valid tokens per row (right padding); default all T.
        Rows past a length give output 0; routing pools only valid keys.
      implementation: passed to the attention ops.
    """

    lengths: Int[Array, " B"] | None = None
    implementation: str = "auto"

    def __call__(self, spec: ElasticAttendSpec, qkv: ElasticQKV, state: Any = None
                 ) -> tuple[Float[Array, "B T N Hv"], Int[Array, "B K"]]:
        from attn.block_sparse import block_sparse_attention

        pooled = ctx_q_pool(qkv.k_pre, self.lengths, boundary=POOL_BOUNDARY)
        z = qkv.route(pooled)
        modes = derive_head_mask_type(z, spec.retrieval_mode, spec.toggle_type, spec.group_size)
        kwargs = dict(block_size=spec.block_size, sink_blocks=spec.sink_blocks,
                      local_blocks=spec.local_blocks, q_lengths=self.lengths,
                      kv_lengths=self.lengths, scale=spec.scale,
                      implementation=self.implementation)
        if spec.uses_xattn:
            o, _ = elastic_prefill_attention(
                qkv.q, qkv.k, qkv.v, modes, stride=spec.stride, threshold=spec.threshold,
                norm=spec.norm, **kwargs)
        else:
            o, _ = block_sparse_attention(qkv.q, qkv.k, qkv.v, modes, None, **kwargs)
        return o, z


@hard_decision
def static_decisions(log_alpha: Float[Array, " K"]) -> Int[Array, " K"]:
    """Deterministic hard-concrete gates of `attn_mask_log_alphas`: 1 retrieval, 0 sparse.

    The HF L0 eval rule (`deterministic_z_from_log_alpha`) with its non-zero gates counted as
    retrieval: `num_zeros = round(Σ_k P(gate_k = 0))` with `P(gate = 0) = clip(sigmoid(β ·
    log(-l / r) - log_alpha), 1e-6, 1 - 1e-6)` (`l = -0.1`, `r = 1.1`, `β = 2/3`), and the
    `num_zeros` heads of smallest `log_alpha` are sparse (ties: lower head index first). HF ranks
    by `sigmoid(0.8 · log_alpha / β)`, the same order except where float rounding saturates it.
    Math in float32. (HF's eval path with `enable_ada_sparsity=False` leaves the soft gate values
    in place and then fails on an undefined name, so this binarisation is our documented rule.)
    A rank, hence not differentiable: a tangent on `log_alpha` raises `TypeError`
    (`attn.elastic.router.hard_decision`).

    Args:
      log_alpha: `[K]` per-KV-head log-alphas of one layer.

    Returns:
      `[K]` int32 in {0, 1}.
    """
    la = jnp.asarray(log_alpha, jnp.float32)
    x01 = (0.0 - _LIMIT_LEFT) / (_LIMIT_RIGHT - _LIMIT_LEFT)
    p_zero = jnp.clip(jax.nn.sigmoid(_BETA * math.log(x01 / (1.0 - x01)) - la), _EPS, 1 - _EPS)
    num_zeros = jnp.round(jnp.sum(p_zero)).astype(jnp.int32)
    rank = jnp.argsort(jnp.argsort(la, stable=True), stable=True)  # 0 = smallest log-alpha
    return (rank >= num_zeros).astype(jnp.int32)


def _is_abstract(dtype) -> bool:
    """True inside `models.layers.linear.abstract_init` (checkpoint loading builds shapes only)."""
    return isinstance(weight(None, (1,), dtype, init="zeros").get_value(), jax.ShapeDtypeStruct)


class PawQwen3Attention(Attention):
    """Qwen3 attention whose `project` also returns pre-RoPE keys and the layer's router.

    Parameters beyond Qwen3's: `router` (an `AttentionRouter`, None when `use_softmax=False`)
    and `attn_mask_log_alphas [K]` (read only when `enable_ada_sparsity=False`; initialised to 1,
    which gives all-retrieval like HF's 4.5 init). The spec is an `ElasticAttendSpec`.
    """

    def __init__(self, cfg: PawQwen3Config, *, layer: int, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg.attention_config(layer), layer=layer, dtype=dtype, rngs=rngs)
        a = cfg.attention
        self.enable_ada_sparsity = cfg.enable_ada_sparsity
        self.spec = ElasticAttendSpec(
            layer=layer, scale=self.spec.scale, retrieval_mode=cfg.retrieval_mode,
            toggle_type=cfg.toggle_type, group_size=a.num_heads // a.num_kv_heads,
            block_size=cfg.block_size, stride=cfg.xattn_stride,
            threshold=float(cfg.xattn_threshold), norm=float(cfg.xattn_norm),
            sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks)
        self.attn_mask_log_alphas = weight(None, (a.num_kv_heads,), dtype, init="ones")
        if not cfg.use_softmax:
            self.router = None
        elif _is_abstract(dtype):
            self.router = nnx.eval_shape(
                lambda: AttentionRouter(a.head_dim, rngs=nnx.Rngs(0), param_dtype=dtype))
        else:
            self.router = AttentionRouter(a.head_dim, rngs=rngs, param_dtype=dtype)

    def project(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"]) -> ElasticQKV:
        """Projections, q/k norms, RoPE; keeps the normed keys before RoPE for the router."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k_pre = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:  # Qwen3 has q/k norms; a Llama backbone made elastic has none
            q, k_pre = self.q_norm(q), self.k_norm(k_pre)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.hv)
        k = k_pre
        if cfg.rope is not None:
            q, k = rotate(cfg.rope, q, positions), rotate(cfg.rope, k_pre, positions)
        return ElasticQKV(q, k, v, None, k_pre, self.route)

    def route(self, pooled: Float[Array, "B K H"]) -> Int[Array, "B K"]:
        """Decisions `z [B, K]` (1 retrieval, 0 sparse) from pooled pre-RoPE keys."""
        if self.enable_ada_sparsity:
            return self.router(pooled)[1]
        z = static_decisions(self.attn_mask_log_alphas[...])
        return jnp.broadcast_to(z, pooled.shape[:2])


class PawQwen3ForCausalLM(Qwen3ForCausalLM):
    """Elastic-attention Qwen3 (PawQwen3). `logits = model(input_ids)` runs elastic prefill.

    `model(ids, elastic=False)` is the dense backbone; `model.router_decisions(ids)` gives the
    per-layer decisions `[L, B, K]`. Decode through the engine stays dense (as in FastDeploy).
    """

    family = "pawqwen3"

    def make_mixer(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return PawQwen3Attention(self.cfg, layer=layer, dtype=self.dtype, rngs=rngs)

    def __call__(self, input_ids: Int[Array, "B T"], *, positions: Int[Array, "B T"] | None = None,
                 segment_ids: Int[Array, "B T"] | None = None,
                 lengths: Int[Array, " B"] | None = None, elastic: bool = True,
                 return_decisions: bool = False, implementation: str = "auto"):
        """Full forward without a cache (jitted).

        Args:
          input_ids: `[B, T]` integer token ids (right-padded rows with `lengths`).
          positions: `[B, T]` positions; default `0..T-1`.
          segment_ids: packed segments; only with `elastic=False` (routing is per row).
          lengths: `[B]` valid tokens per row (elastic only); logits past a length are
            unspecified.
          elastic: False = the dense Qwen3 backbone (router unused).
          return_decisions: also return the router decisions `[L, B, K]` int32.
          implementation: attention backend.

        Returns:
          logits `[B, T, V]`, or `(logits, z [L, B, K])` with `return_decisions`.

        Raises:
          ValueError: bad shapes or lengths; `return_decisions` / `lengths` without `elastic`.
          TypeError: non-integer inputs.
          NotImplementedError: `segment_ids` with elastic attention.
        """
        if not elastic:
            if return_decisions or lengths is not None:
                raise ValueError("return_decisions and lengths need elastic=True")
            return super().__call__(input_ids, positions=positions, segment_ids=segment_ids,
                                    implementation=implementation)
        if segment_ids is not None:
            raise NotImplementedError("segment_ids (packed sequences) are not supported with "
                                      "elastic attention: the router decides per row")
        ids = jnp.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must have shape [B, T]; got shape {ids.shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"input_ids.dtype={ids.dtype} must be an integer type")
        b, t = ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = jnp.asarray(positions)
        if positions.shape != ids.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"positions must be integer [B, T]={ids.shape}; got "
                             f"{positions.dtype}{list(positions.shape)}")
        if lengths is not None:
            lengths = jnp.asarray(lengths)
            if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
                raise ValueError(f"lengths must be integer [B]=({b},); got "
                                 f"{lengths.dtype}{list(lengths.shape)}")
            values = concrete(lengths)  # None under an outer jit: checked at run time only
            if values is not None and ((values < 0).any() or (values > t).any()):
                raise ValueError(f"lengths={values.tolist()} must lie in [0, T={t}]")
            lengths = lengths.astype(jnp.int32)
        logits, z = _elastic_forward(self, ids.astype(jnp.int32), positions.astype(jnp.int32),
                                     lengths, implementation=implementation)
        return (logits, z) if return_decisions else logits

    def router_decisions(self, input_ids: Int[Array, "B T"], *,
                         positions: Int[Array, "B T"] | None = None,
                         lengths: Int[Array, " B"] | None = None) -> Int[Array, "L B K"]:
        """Per-layer router decisions (1 retrieval, 0 sparse) of an elastic forward.

        Layer l's decision depends on the hidden states, hence on the elastic attention of the
        layers before it, so this runs the full elastic forward.
        """
        return self(input_ids, positions=positions, lengths=lengths, return_decisions=True)[1]

    def static_decisions(self) -> Int[Array, "L K"]:
        """`static_decisions` of every layer's `attn_mask_log_alphas` (used when
        `enable_ada_sparsity=False`)."""
        return jnp.stack([static_decisions(layer.mixer.attn_mask_log_alphas[...])
                          for layer in self.layers])


@nnx.jit(static_argnames=("implementation",))
def _elastic_forward(model: PawQwen3ForCausalLM, input_ids, positions, lengths, *,
                     implementation):
    attend = ElasticAttend(lengths=lengths, implementation=implementation)
    hidden, decisions = model.forward(input_ids, positions, attend=attend)
    return model.logits(hidden), jnp.stack(decisions)


def config_from_hf(hf: HFConfig) -> PawQwen3Config:
    """Qwen3 fields plus the elastic ones (HF `PawQwen3Config` defaults when absent).

    Raises:
      ConfigError: a missing / ill-typed field, or an invalid elastic setting (named).
    """
    base = _qwen3_config_from_hf(hf)
    kinds = {"local_window_size": int, "sink_size": int, "toggle_type": str,
             "retrieval_mode": str, "enable_ada_sparsity": bool, "pooling_mode": str,
             "use_softmax": bool, "xattn_stride": int, "xattn_threshold": float,
             "xattn_norm": float, "block_size": int}
    fields = {name: hf.optional(name, kind, HF_DEFAULTS[name]) for name, kind in kinds.items()}
    fields["testing_small_blocks"] = hf.optional("longctx_testing_small_blocks", bool, False)
    base_fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderConfig)}
    try:
        return PawQwen3Config(**base_fields, **fields)
    except ConfigError as e:
        raise ConfigError(f"{hf.source}: {e}") from None


def rules(cfg: PawQwen3Config) -> list:
    """Qwen3's name map plus each layer's router and `attn_mask_log_alphas`."""
    out = decoder_rules(cfg)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.self_attn", f"layers/{i}/mixer"
        out.append(param(f"{dst}/attn_mask_log_alphas", f"{src}.attn_mask_log_alphas"))
        if not cfg.use_softmax:
            continue
        for seq, indices in HF_LINEARS.items():
            for j in indices:
                out += linear(f"{dst}/router/{seq}/layers/{j}", f"{src}.mask_allocator.{seq}.{j}",
                              bias=True)
    return out


def ignore(cfg: PawQwen3Config) -> tuple[str, ...]:
    """Qwen3's ignore list plus training-only tensors (and the unused sigmoid router)."""
    attn = r"model\.layers\.\d+\.self_attn\."
    pats = (rf"{attn}mask_allocator\.log_temp", rf"{attn}mask_allocator\.task_embedding\.weight",
            r"model\.sparsity_lambda_[12]", r"model\.sparsity_lambda[12]_task")
    if not cfg.use_softmax:
        pats += (rf"{attn}mask_allocator\.cls_(feat_extractor|router_head_agnostic)\.\d+\."
                 r"(weight|bias)",)
    return _llama_ignore(cfg) + pats


FAMILY = register(Family(
    name="pawqwen3", model_cls=PawQwen3ForCausalLM, config_cls=PawQwen3Config,
    config_from_hf=config_from_hf, rules=rules, hf_architectures=("PawQwen3ForCausalLM",),
    ignore=ignore,
))
