"""The eagle_tiers scenario's readers without servers: the mirrored-draft checkpoint (its
NextN layer computes what the target's layer 0 does) and the draft-bytes check of L3 objects
(``testing/server/draft_bytes.py``). Runs in both venvs."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch

from sglang_cp_hicache.testing.server.draft_bytes import INDEXER, KV, PageGeometry, check_draft_bytes, file_objects, geometry_of
from sglang_cp_hicache.testing.server.tiny_model import (
    EMBED_RMS,
    MIRRORED_DRAFT,
    TAIL_SCALE,
    TinyDsaSpec,
    build_checkpoint,
)

SMALL = dict(seed=5, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=64, vocab_size=300)


# ------------------------------------------------------------------------ checkpoint
def test_mirrored_draft_copies_layer_0_reads_the_embedding_and_shrinks_the_tail(tmp_path):
    from safetensors.torch import load_file

    spec = TinyDsaSpec(**SMALL, first_k_dense_replace=0, draft_mirrors_target=True)
    build_checkpoint(spec, tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    plain = TinyDsaSpec(**SMALL, first_k_dense_replace=0)
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    build_checkpoint(plain, plain_dir)
    p = load_file(str(plain_dir / "model.safetensors"))
    nextn = f"model.layers.{spec.num_hidden_layers}."
    copied = [n for n in w if n.startswith("model.layers.0.")]
    assert copied and all(torch.equal(w[nextn + n[len("model.layers.0."):]], w[n]) for n in copied)
    assert torch.equal(w[nextn + "shared_head.head.weight"], w["lm_head.weight"])
    assert torch.equal(w[nextn + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    rms = w["model.embed_tokens.weight"].float().pow(2).mean(dim=1).sqrt()
    assert torch.allclose(rms, torch.full_like(rms, EMBED_RMS), rtol=0.01)
    h = spec.hidden_size
    eh = w[nextn + "eh_proj.weight"].float()
    assert torch.equal(eh[:, :h], torch.eye(h) * EMBED_RMS) and not eh[:, h:].any()  # eh_proj(enorm(e)) == e
    assert torch.allclose(w["model.layers.1.self_attn.o_proj.weight"].float(), p["model.layers.1.self_attn.o_proj.weight"].float() * TAIL_SCALE, rtol=0.01)
    assert torch.equal(w["model.layers.1.self_attn.kv_b_proj.weight"], p["model.layers.1.self_attn.kv_b_proj.weight"])


def test_the_default_checkpoint_keeps_its_name_and_the_mirror_needs_moe_everywhere():
    assert TinyDsaSpec().name == "glm5-tiny-dsa-ceaa53523d32"
    assert MIRRORED_DRAFT.name != TinyDsaSpec().name
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        TinyDsaSpec(draft_mirrors_target=True)


# ------------------------------------------------------------------------ draft bytes
GEOMETRY = PageGeometry(page_size=4, target_layers=2, draft_layers=1, kv_bytes_per_token=6, indexer_bytes_per_token=3)


def _layers(kind: str, seed: int):
    rng = random.Random(seed)
    per = GEOMETRY.page_size * (GEOMETRY.kv_bytes_per_token if kind == KV else GEOMETRY.indexer_bytes_per_token)
    return [bytes(rng.randrange(1, 256) for _ in range(per)) for _ in range(GEOMETRY.layers)]


def _token_major(layers):
    row = GEOMETRY.kv_bytes_per_token
    return b"".join(layer[t * row : (t + 1) * row] for t in range(GEOMETRY.page_size) for layer in layers)


PAGES = ["a" * 64, "b" * 64]


def _objects(suffix: str, token_major: bool = False, draft=None):
    objects = {}
    for i, page in enumerate(PAGES):
        for kind in (KV, INDEXER):
            layers = _layers(kind, zlib.crc32(f"{page}{kind}".encode()))
            if draft is not None:
                layers[-1] = draft(layers[-1])
            data = _token_major(layers) if kind == KV and token_major else b"".join(layers)
            objects[f"{page}{suffix}-{kind}"] = data
    return objects


@pytest.mark.parametrize("token_major", [False, True])
def test_draft_bytes_equal_to_the_reference_pass(token_major):
    check = check_draft_bytes(_objects("_s", token_major), _objects("_cp0_2"), PAGES, GEOMETRY, token_major)
    assert check.problems == () and check.pages == 2 and check.objects == 4


@pytest.mark.parametrize(
    "draft, named",
    [
        (lambda layer: bytes(len(layer)), "draft's kv layers are all zero"),  # the draft never backed up
        (lambda layer: layer[::-1], "draft's kv bytes differ"),  # another page's / stale rows
    ],
)
def test_a_missing_or_wrong_draft_is_named(draft, named):
    check = check_draft_bytes(_objects("_s", draft=draft), _objects("_cp0_2"), PAGES, GEOMETRY)
    assert any(named in problem for problem in check.problems), check.problems


def test_an_object_without_the_draft_layer_or_a_missing_page_is_named():
    objects = _objects("_s")
    key = f"{PAGES[0]}_s-{KV}"
    objects[key] = objects[key][: 2 * len(objects[key]) // 3]  # target layers only
    check = check_draft_bytes(objects, _objects("_cp0_2"), [*PAGES, "c" * 64], GEOMETRY)
    assert any("is no page of 3 layers" in p for p in check.problems)
    assert any(p.startswith(f"page {PAGES[0][:12]}: 0 sharded kv objects") for p in check.problems)
    assert any(p.startswith("page cccccccccccc: 0 sharded kv") for p in check.problems)


def test_geometry_of_the_tiny_checkpoint_and_file_objects(tmp_path: Path):
    geometry = geometry_of(MIRRORED_DRAFT, 64)
    assert geometry.kind(3 * 64 * 576 * 2) == KV and geometry.kind(3 * 64 * 132) == INDEXER
    assert geometry.kind(2 * 64 * 576 * 2) is None  # no draft layer
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / f"{'d' * 64}_x.bin").write_bytes(b"12")
    (tmp_path / "notes.bin").write_bytes(b"3")
    assert file_objects(tmp_path) == {f"{'d' * 64}_x": b"12"}
