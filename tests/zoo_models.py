"""Tiny random-init HuggingFace models for the placement zoo: one entry per family.

Each entry builds the model (hidden 32, 1–2 layers, vocab 99, dropout 0, no cache), says which
modules do the input lookups (tagged "cpu" by the test) and makes a batch of a given size.
Nothing is downloaded: configs are written here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

VOCAB = 99


@dataclasses.dataclass
class Family:
    build: Callable[[], nn.Module]
    lookups: Callable[[nn.Module], list[nn.Module]]
    batch: Callable[[torch.Generator, int, int], dict]


def _tokens(gen: torch.Generator, b: int, s: int) -> dict:
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _seq2seq(gen: torch.Generator, b: int, s: int) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (b, s), generator=gen),
            "labels": torch.randint(1, VOCAB, (b, s - 1), generator=gen)}


def _images(gen: torch.Generator, b: int, s: int) -> dict:
    return {"pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 3, (b,), generator=gen)}


def _audio(gen: torch.Generator, b: int, s: int) -> dict:
    return {"input_features": torch.randn(b, 8, 32, generator=gen),
            "labels": torch.randint(1, VOCAB, (b, s), generator=gen)}


def _input_embeddings(model: nn.Module) -> list[nn.Module]:
    return [model.get_input_embeddings()]


def _encoder_decoder_lookups(model: nn.Module) -> list[nn.Module]:
    return [model.get_encoder().embed_tokens, model.get_decoder().embed_tokens]


def _decoder_only(name: str, **extra) -> Family:
    def build() -> nn.Module:
        import transformers as tf

        config_cls = getattr(tf, f"{name}Config")
        model_cls = getattr(tf, f"{name}ForCausalLM")
        common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=64, use_cache=False, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
        return model_cls(config_cls(**{**common, **extra}))

    return Family(build, _input_embeddings, _tokens)


def _hf(config: str, model: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers as tf

        return getattr(tf, model)(getattr(tf, config)(**kwargs))
    return build


ZOO: dict[str, Family] = {
    "gpt2": Family(_hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=2,
                       n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0),
                   _input_embeddings, _tokens),
    "llama": _decoder_only("Llama", num_key_value_heads=2),
    "mistral": _decoder_only("Mistral", num_key_value_heads=2, sliding_window=8),
    "qwen2": _decoder_only("Qwen2", num_key_value_heads=2),
    "gemma": _decoder_only("Gemma", num_key_value_heads=2, head_dim=8),
    "phi": _decoder_only("Phi", resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gpt_neox (parallel residual)": Family(
        _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=32,
            num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, use_parallel_residual=True, hidden_dropout=0.0,
            attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0),
        _input_embeddings, _tokens),
    "bloom (alibi)": Family(
        _hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32, n_layer=2,
            n_head=4, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0),
        _input_embeddings, _tokens),
    "mixtral (moe)": _decoder_only("Mixtral", num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2, router_aux_loss_coef=0.0),
    "opt": Family(
        _hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32,
            num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=1),
        _input_embeddings, _tokens),
    "bert": Family(
        _hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=32,
            num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0),
        lambda m: [m.bert.embeddings.word_embeddings], _tokens),
    "t5": Family(
        _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=8,
            d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
            use_cache=False),
        _encoder_decoder_lookups, _seq2seq),
    "bart": Family(
        _hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=32,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, use_cache=False),
        _encoder_decoder_lookups, _seq2seq),
    "vit (images)": Family(
        _hf("ViTConfig", "ViTForImageClassification", hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4,
            num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        lambda m: [m.vit.embeddings.patch_embeddings], _images),
    "whisper (audio encoder-decoder)": Family(
        _hf("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB, d_model=32,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            num_mel_bins=8, max_source_positions=16, max_target_positions=32, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
            decoder_start_token_id=0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
            suppress_tokens=[], begin_suppress_tokens=[]),
        lambda m: [m.model.encoder.conv1, m.model.decoder.embed_tokens], _audio),
}
