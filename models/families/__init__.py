"""Model families; importing this package registers each with `models.convert.registry`.

Adding a family (see `llama.py` and `qwen3.py`, ~100 lines each):

1. Config. Reuse `DecoderConfig` (`models/transformer.py`) or subclass it / `ConfigBase` with a
   frozen, kw_only dataclass validated in `__post_init__` (`models.config.check_*` helpers raise
   `ConfigError` naming the field). Nested configs (`AttentionConfig`, `RopeConfig`) round-trip
   through `to_dict` / `from_dict`, which is what orbax checkpoints store.
2. Parsing. `config_from_hf(hf: HFConfig) -> config`: `hf.require` / `hf.optional` name missing
   or ill-typed fields; `rope_from_hf` parses every HF rope format.
3. Model. Subclass `CausalLM`, set `family = "<name>"`, override `make_mixer(layer, rngs)`
   (an `Attention` subclass with its own `project` / `output`, or any module with
   `__call__(x, positions, *, attend, state) -> (y, state)`), `make_mlp` (e.g. `MoE(router,
   SwiGLUExperts(...), shared=...)` with the family's router) and `make_norm`. Create
   parameters with `models.layers.linear.weight` so conversion builds the model abstractly.
4. Name map. `rules(cfg) -> list[Rule]`: `decoder_rules` covers the Llama layout; add
   `mapping.linear`, `mapping.param`, `mapping.stacked_experts` (per-expert HF tensors →
   `[E, in, out]`) or a `Rule` with any jnp transform. The loader checks that the rules cover
   every parameter once and every checkpoint tensor once (or matches the family's `ignore`).
5. Register. `register(Family(name=..., model_cls=..., config_cls=..., config_from_hf=...,
   rules=..., hf_architectures=("XForCausalLM",), ignore=..., gguf_architectures=(...),
   gguf_config=..., gguf_to_hf=..., gguf_fixup=...))` at module import, and import the module
   below. `from_pretrained`, `save`, `load` and `experiments/convert.py` then work unchanged.
6. Engine (only for a mixer the built-in adapters do not serve). Subclass
   `models.engine.adapters.MixerAdapter` (or one of its adapters), decorate it with
   `register_adapter`, and import its module below (`pawqwen3_engine.py`).
"""

from models.families.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from models.families.llama import LlamaForCausalLM
from models.families.pawqwen3 import PawQwen3ForCausalLM
from models.families.pawqwen3_engine import ElasticAdapter  # registers the engine adapter
from models.families.qwen3 import Qwen3ForCausalLM
from models.families.qwen3_5 import Qwen3_5ForCausalLM
from models.families.qwen3_next import Qwen3NextForCausalLM

__all__ = [
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "ElasticAdapter",
    "LlamaForCausalLM",
    "PawQwen3ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
]
