"""Config-only checkpoints: the real Ming-flash thinker shape (ming.md §2.1) and a tokenizer, no weights."""

from __future__ import annotations

import json
import math

from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.common.cli import main
from omnistage.services.thinker.models.bailing_moe_v2 import checkpoint_shapes
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.tokenizer import MingTokenizer


def test_the_ming_flash_shape_without_weights(tmp_path):
    assert main(["make-config-checkpoint", "--shape", "ming-flash", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("*.safetensors*"))
    cfg = ThinkerConfig.from_checkpoint(tmp_path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (157184, 4096, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 1024)
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace, cfg.intermediate_size) == (8, 4, 1, 9216)
    assert cfg.rope_type == "video_rope" and cfg.multi_router and cfg.rotary_dim == 64
    params = sum(math.prod(s) for s in checkpoint_shapes(cfg).values())
    assert 102e9 < params < 104e9  # ~103 B: the thinker of Ming-flash-omni-2.0
    tok = MingTokenizer(tmp_path)
    assert cfg.eos_token_id in tok.stop_token_ids and max(tok.encode("Hello, world")) < cfg.vocab_size


def test_the_tiny_shape_sizes_its_vocabulary_to_the_tokenizer(tmp_path):
    write_config_checkpoint(tmp_path, "tiny")
    llm = json.loads((tmp_path / "config.json").read_text())["llm_config"]
    added = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert (
        llm["vocab_size"] % 64 == 0 and max(map(int, added)) < llm["vocab_size"] < max(map(int, added)) + 65
    )
