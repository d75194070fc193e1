"""A tiny GLM-5-shaped DSA checkpoint, made locally and deterministically from a seed.

``GlmMoeDsaForCausalLM`` with everything SGLang's DSA path reads on a real GLM-5: MLA
(q/kv LoRA ranks, rope and nope heads), the NSA indexer (4 heads of 128, ``index_topk``
128, so a prompt of more than 128 tokens runs sparse selection), MoE (4 routed experts,
top-2, one shared, the first layer dense), yarn rope (SGLang's CPU rope supports only
``deepseek_yarn``) and one NextN MTP layer (the EAGLE draft's weights; a target model skips
them). Weights are random, std :data:`WEIGHT_STD`: with ``--load-format dummy`` the logits
are near uniform and a sharded-vs-unsharded comparison says little, while these give
informative logprobs. Norm weights are ones and biases zeros, as a trained model starts.

``draft_mirrors_target``: a variant whose EAGLE drafts get accepted (the random NextN layer
of the default accepts none). Every layer is MoE; the NextN layer is a copy of layer 0 and
reads only the next token's embedding (``eh_proj`` = [``EMBED_RMS`` I, 0], embedding rows of
RMS ``EMBED_RMS``, so ``eh_proj(enorm(e))`` is ``e``), its head the target's; the target's
later layers write to the residual through output projections scaled by ``TAIL_SCALE``. The
draft at position t over tokens 1..t+1 then computes what the target's layer 0 computes at
position t+1 over tokens 0..t+1 (RoPE is relative), so its guess is mostly the target's next
token, and it reads its own KV to make it: a wrong draft KV shows as fewer accepted drafts.

The byte-level BPE tokenizer is trained on a fixed text, so the same seed always gives the
same files. Nothing is downloaded: the config and the tensor names are written here (the
DeepSeek/GLM checkpoint naming SGLang's loader reads, per-expert MoE tensors), not derived
from a transformers version, so both SGLang lines' venvs build the same bytes.

:func:`ensure_checkpoint` builds it once under a folder named by the spec's digest and
returns the folder; a half-written folder is never returned (built beside, then renamed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Tuple

logger = logging.getLogger(__name__)

WEIGHT_STD = 0.08
#: Where checkpoints are kept unless told otherwise (git-ignored at the repository root).
DEFAULT_CACHE = Path(__file__).resolve().parents[4] / ".models"
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
FORMAT_VERSION = 1  # bump when the files written for one spec change
EMBED_RMS = 0.0625  # a power of two: exact in bf16 (draft_mirrors_target)
TAIL_SCALE = 0.1  # the target's layers past 0 write this much to the residual (draft_mirrors_target)


@dataclass(frozen=True)
class TinyDsaSpec:
    """The tiny model's geometry (GLM-5's shape, scaled down) and its seed."""

    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 128
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 4096
    draft_mirrors_target: bool = False

    def __post_init__(self) -> None:
        if self.draft_mirrors_target and self.first_k_dense_replace != 0:
            raise ValueError("draft_mirrors_target copies layer 0 into the (MoE) NextN layer: first_k_dense_replace must be 0")

    @property
    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.draft_mirrors_target:
            del fields["draft_mirrors_target"]  # the default checkpoint keeps its name
        payload = json.dumps({**fields, "format": FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        return f"glm5-tiny-dsa-{self.digest}"

    def config(self) -> dict:
        """``config.json``: a ``glm_moe_dsa`` config both lines' transformers accept."""
        return {
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "torch_dtype": "bfloat16",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_head_dim": self.qk_nope_head_dim + self.qk_rope_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "moe_layer_freq": 1,
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": 10000.0,
            # yarn: SGLang's CPU rope (get_rope_cpu) only implements deepseek_yarn.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 1.0,
                "original_max_position_embeddings": self.max_position_embeddings,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    # ------------------------------------------------------------------ tensors
    def _layer_tensors(self, prefix: str, moe: bool) -> Iterator[Tuple[str, Tuple[int, ...]]]:
        h, heads = self.hidden_size, self.num_attention_heads
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        attn = f"{prefix}.self_attn"
        yield f"{attn}.q_a_proj.weight", (self.q_lora_rank, h)
        yield f"{attn}.q_a_layernorm.weight", (self.q_lora_rank,)
        yield f"{attn}.q_b_proj.weight", (heads * qk_head, self.q_lora_rank)
        yield f"{attn}.kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope_head_dim, h)
        yield f"{attn}.kv_a_layernorm.weight", (self.kv_lora_rank,)
        yield f"{attn}.kv_b_proj.weight", (
            heads * (self.qk_nope_head_dim + self.v_head_dim),
            self.kv_lora_rank,
        )
        yield f"{attn}.o_proj.weight", (h, heads * self.v_head_dim)
        index = f"{attn}.indexer"
        yield f"{index}.wq_b.weight", (self.index_n_heads * self.index_head_dim, self.q_lora_rank)
        yield f"{index}.wk.weight", (self.index_head_dim, h)
        yield f"{index}.k_norm.weight", (self.index_head_dim,)
        yield f"{index}.k_norm.bias", (self.index_head_dim,)
        yield f"{index}.weights_proj.weight", (self.index_n_heads, h)
        mlp = f"{prefix}.mlp"
        if moe:
            yield f"{mlp}.gate.weight", (self.n_routed_experts, h)
            yield f"{mlp}.gate.e_score_correction_bias", (self.n_routed_experts,)
            for e in range(self.n_routed_experts):
                yield f"{mlp}.experts.{e}.gate_proj.weight", (self.moe_intermediate_size, h)
                yield f"{mlp}.experts.{e}.up_proj.weight", (self.moe_intermediate_size, h)
                yield f"{mlp}.experts.{e}.down_proj.weight", (h, self.moe_intermediate_size)
            shared = self.moe_intermediate_size * self.n_shared_experts
            yield f"{mlp}.shared_experts.gate_proj.weight", (shared, h)
            yield f"{mlp}.shared_experts.up_proj.weight", (shared, h)
            yield f"{mlp}.shared_experts.down_proj.weight", (h, shared)
        else:
            yield f"{mlp}.gate_proj.weight", (self.intermediate_size, h)
            yield f"{mlp}.up_proj.weight", (self.intermediate_size, h)
            yield f"{mlp}.down_proj.weight", (h, self.intermediate_size)
        yield f"{prefix}.input_layernorm.weight", (h,)
        yield f"{prefix}.post_attention_layernorm.weight", (h,)

    def tensors(self) -> Dict[str, Tuple[int, ...]]:
        """Every checkpoint tensor's name and shape, in a fixed order."""
        h = self.hidden_size
        shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_hidden_layers):
            shapes.update(self._layer_tensors(f"model.layers.{layer}", layer >= self.first_k_dense_replace))
        for nextn in range(self.num_nextn_predict_layers):
            prefix = f"model.layers.{self.num_hidden_layers + nextn}"
            shapes.update(self._layer_tensors(prefix, moe=True))
            shapes[f"{prefix}.embed_tokens.weight"] = (self.vocab_size, h)
            shapes[f"{prefix}.enorm.weight"] = (h,)
            shapes[f"{prefix}.hnorm.weight"] = (h,)
            shapes[f"{prefix}.eh_proj.weight"] = (h, 2 * h)
            shapes[f"{prefix}.shared_head.norm.weight"] = (h,)
            shapes[f"{prefix}.shared_head.head.weight"] = (self.vocab_size, h)
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def _tensor(spec: TinyDsaSpec, name: str, shape: Tuple[int, ...]):
    """One tensor: random normal (std :data:`WEIGHT_STD`) for matrices, from a generator
    seeded by the spec's seed and the name (independent of order and of other tensors)."""
    if spec.draft_mirrors_target:
        return _mirrored_tensor(spec, name, shape)
    return _random_tensor(spec, name, shape)


def _random_tensor(spec: TinyDsaSpec, name: str, shape: Tuple[int, ...]):
    import torch

    if len(shape) >= 2:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{spec.seed}:{name}".encode()))
        return (torch.randn(shape, generator=generator) * WEIGHT_STD).to(torch.bfloat16)
    fill = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.0
    return torch.full(shape, fill, dtype=torch.bfloat16)


def _mirrored_tensor(spec: TinyDsaSpec, name: str, shape: Tuple[int, ...]):
    """``name`` in the ``draft_mirrors_target`` variant (the module docstring says why)."""
    import torch

    nextn = f"model.layers.{spec.num_hidden_layers}."
    if name.startswith(nextn):
        local = name[len(nextn):]
        if local == "eh_proj.weight":
            h = spec.hidden_size
            return torch.cat((torch.eye(h) * EMBED_RMS, torch.zeros(h, h)), dim=1).to(torch.bfloat16)
        if local == "embed_tokens.weight":
            return _mirrored_tensor(spec, "model.embed_tokens.weight", shape)
        if local == "shared_head.head.weight":
            return _random_tensor(spec, "lm_head.weight", shape)
        if local in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            return _random_tensor(spec, name, shape)
        return _random_tensor(spec, f"model.layers.0.{local}", shape)
    weight = _random_tensor(spec, name, shape)
    if name == "model.embed_tokens.weight":
        rms = weight.float().pow(2).mean(dim=1, keepdim=True).sqrt()
        return (weight.float() / rms * EMBED_RMS).to(torch.bfloat16)
    if name.startswith("model.layers.") and not name.startswith("model.layers.0.") and name.endswith(("o_proj.weight", "down_proj.weight")):
        return (weight.float() * TAIL_SCALE).to(torch.bfloat16)
    return weight


TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. ",
    "Hello world, this is a tiny test of sglang on cpu. ",
    "Once upon a time there was a small model that served http requests. ",
    "Prefill context parallel with shared KV and a hierarchical cache. ",
)


def _write_tokenizer(spec: TinyDsaSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(TOKENIZER_TEXT) * 50, trainer)
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids > vocab {spec.vocab_size}")
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos, pad = SPECIAL_TOKENS
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "pad_token": pad,
        "model_max_length": spec.max_position_embeddings,
        "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
    }, indent=1))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": pad})
    )


def build_checkpoint(spec: TinyDsaSpec, folder: Path) -> None:
    """Write config, tokenizer and weights of ``spec`` into an empty ``folder``."""
    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(spec.config(), indent=1, sort_keys=True))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )
    _write_tokenizer(spec, folder)
    weights = {name: _tensor(spec, name, shape) for name, shape in spec.tensors().items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def ensure_checkpoint(spec: TinyDsaSpec = TinyDsaSpec(), cache: Path = DEFAULT_CACHE) -> Path:
    """The folder of ``spec``'s checkpoint under ``cache``, built first if it is not there."""
    folder = cache / spec.name
    if (folder / "model.safetensors").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=cache))
    try:
        build_checkpoint(spec, scratch)
        try:
            os.rename(scratch, folder)  # atomic: a reader never sees half a checkpoint
        except OSError:
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("tiny DSA checkpoint %s built in %s", spec.name, folder)
    return folder


#: The checkpoint whose EAGLE drafts get accepted (the ``eagle_tiers`` scenario's).
MIRRORED_DRAFT = TinyDsaSpec(first_k_dense_replace=0, draft_mirrors_target=True)

__all__ = ["DEFAULT_CACHE", "EMBED_RMS", "MIRRORED_DRAFT", "TAIL_SCALE", "TinyDsaSpec", "WEIGHT_STD", "build_checkpoint", "ensure_checkpoint"]
