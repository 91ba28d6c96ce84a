"""The engine's sampling: a sample request on its slot (a training model's or a sampler checkpoint loaded into a
free one), its stop conditions, shapes and prompt logprobs.

`Sampler` owns the tokenizer and the model's end-of-sequence ids (`load_tokenizer`). It reads the store (the
sampling session, the checkpoint), the slot table, the device state and the models (a sampler checkpoint takes a
free slot by their rules: the rank policy, eviction, the served base model)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from tinker import types

from trainer.base.config import ModelConfig, ServiceConfig
from trainer.model import lora as L
from trainer.service import losses, protocol, sampling
from trainer.service.device import DeviceState
from trainer.service.engine.common import (
    UserError,
    _stable_int,
)
from trainer.service.engine.models import Models
from trainer.service.passes import datum_length
from trainer.service.shapes import bucket
from trainer.service.slots import Slot, SlotTable
from trainer.service.store import Request, Store


def load_tokenizer(tok_dir: str | None) -> tuple[Any, tuple[int, ...]]:
    """The model's tokenizer (None without a tokenizer.json) and its end-of-sequence ids (generation_config.json,
    config.json, the tokenizer's own), sorted."""
    tokenizer = None
    if tok_dir is not None and (Path(tok_dir) / "tokenizer.json").is_file():
        from trainer.model.tokenizer import HFTokenizer

        tokenizer = HFTokenizer.from_dir(tok_dir)
    ids: list[int] = []
    if tok_dir is not None:
        for name in ("generation_config.json", "config.json"):
            path = Path(tok_dir) / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    if tokenizer is not None:
        ids.append(tokenizer.eos_id)
    return tokenizer, tuple(sorted(set(ids)))


class Sampler:
    """Runs sample requests (see the module docstring). `tokenizer`, `eos_ids`: what load_tokenizer found."""

    def __init__(self, store: Store, slots: SlotTable, state: DeviceState, mcfg: ModelConfig, service: ServiceConfig,
                 *, models: Models, tokenizer: Any, eos_ids: tuple[int, ...]) -> None:
        self.store = store
        self.slots = slots
        self.state = state
        self.mcfg = mcfg
        self.service = service
        self.progs = state.progs
        self.models = models
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def warm_up(self) -> None:
        """Run the sample program of a one-token prompt with max_tokens 1 once, on the base model."""
        rows, chunk, plen, new = self._sample_shape(1, 1, 1)
        prompt = np.zeros((rows, plen), np.int32)
        valid = np.zeros(prompt.shape, bool)
        valid[:, 0] = True
        settings = sampling.row_settings(types.SamplingParams(max_tokens=1), rows, self.eos_ids[:1],
                                         self.mcfg.vocab_size)
        key = np.asarray(jax.random.key_data(jax.random.PRNGKey(0)))
        self.state.sample(prompt, valid, np.full((rows,), -1, np.int32), key, tuple(settings), (new, 0, chunk))

    # -- sampling ------------------------------------------------------------------------------------------------

    def _sampler_slot(self, owner_id: str, model_path: str | None) -> int:
        if model_path is None:
            return -1
        ckpt = self.store.get_checkpoint(owner_id, model_path)
        for slot in self.slots.values():
            if slot.storage_path == ckpt.storage_path:
                slot.last_used = time.monotonic()
                return slot.index
        single, single_cfg = L.import_peft(ckpt.storage_path, self.mcfg)
        self.models.check_rank(single_cfg.rank)
        index = self.models.free_slot()
        # A sampler checkpoint keeps its own scale (the alpha its files say).
        slot = Slot(index, single_cfg.rank, tuple(single_cfg.targets), single_cfg.scale, storage_path=ckpt.storage_path)
        self.slots.occupy(slot, jax.tree.map(lambda x: np.asarray(x, np.float32), single), single_cfg)
        return index

    def _stops(self, stop: str | Sequence[str] | Sequence[int] | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if stop is None:
            return self.eos_ids, ()
        if isinstance(stop, str):
            stop = [stop]
        if all(isinstance(s, int) for s in stop):
            return tuple(int(s) for s in stop), ()
        if self.tokenizer is None:
            raise UserError("stop strings need the model's tokenizer, which this server does not have; pass token ids")
        return self.eos_ids, tuple(str(s) for s in stop)

    def sample(self, row: Request) -> bytes:
        req: types.SampleRequest = protocol.decode_json(row.kind, row.body)
        unsupported = [name for name, on in (
            ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
            ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0)) if on]
        if unsupported:
            raise UserError(f"{', '.join(unsupported)} not supported by this server")
        sp = req.sampling_params
        if wrong := sampling.problems(sp, req.num_samples, self.service.max_num_samples):
            raise UserError("; ".join(wrong))
        assert sp.max_tokens is not None
        if sp.top_k > self.mcfg.vocab_size:
            raise UserError(f"sampling_params.top_k must be at most this model's vocabulary ({self.mcfg.vocab_size}), "
                            f"not {sp.top_k}")
        prompt = np.array(req.prompt.to_ints(), np.int32)
        if len(prompt) == 0:
            raise UserError("the prompt is empty")
        if len(prompt) + sp.max_tokens > self.mcfg.max_seq_len:
            raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({sp.max_tokens}) exceed this model's "
                            f"context of {self.mcfg.max_seq_len}")
        if prompt.min() < 0 or prompt.max() >= self.mcfg.vocab_size:
            raise UserError(f"prompt token ids must be in [0, {self.mcfg.vocab_size})")
        sampler = self.store.get_sampling_session(row.owner_id, req.sampling_session_id or "")
        self.models.served(sampler.base_model)
        slot = self._sampler_slot(row.owner_id, sampler.model_path)
        stop_ids, stop_strs = self._stops(sp.stop)
        if len(stop_ids) > sampling.MAX_STOP_IDS:
            raise UserError(f"sampling_params.stop: {len(stop_ids)} stop token ids; at most {sampling.MAX_STOP_IDS}")
        seed = sp.seed if sp.seed is not None else _stable_int(row.request_id)
        key = jax.random.PRNGKey(seed)
        n = req.num_samples
        rows, chunk, plen, new = self._sample_shape(len(prompt), sp.max_tokens, n)
        prompt_BP = np.zeros((rows, plen), np.int32)
        valid_BP = np.zeros((rows, plen), bool)
        prompt_BP[:, :len(prompt)] = prompt
        valid_BP[:, :len(prompt)] = True
        slot_B = np.full((rows,), slot, np.int32)
        per_row = sampling.row_settings(sp, rows, stop_ids, self.mcfg.vocab_size)
        tokens, logprobs, mask = self.state.sample(prompt_BP, valid_BP, slot_B, np.asarray(jax.random.key_data(key)),
                                                   tuple(per_row), (new, 0, chunk))
        sequences = [self._sequence(tokens[b], logprobs[b], mask[b], stop_ids, stop_strs) for b in range(n)]
        prompt_lp = self._prompt_logprobs(prompt, slot) if req.prompt_logprobs else None
        topk = self._prompt_topk(prompt, slot, req.topk_prompt_logprobs) if req.topk_prompt_logprobs > 0 else None
        return protocol.encode_sample_response(sequences, prompt_logprobs=prompt_lp, topk_prompt_logprobs=topk)

    def _sample_shape(self, prompt_len: int, max_tokens: int, n: int) -> tuple[int, int, int, int]:
        """The shapes that pick a sample's program: rows (n's row bucket, a multiple of the chunk decoded at once),
        the chunk, the prompt bucket and the token bucket (each row stops at its own max_tokens inside it). Needs
        prompt_len + max_tokens <= the context."""
        svc = self.service
        chunk = min(svc.sample_max_sequences, self.progs.rows(n))
        rows = -(-self.progs.rows(n) // chunk) * chunk
        plen = bucket(prompt_len, svc.min_bucket, self.mcfg.max_seq_len - max_tokens)
        return rows, chunk, plen, bucket(max_tokens, svc.min_bucket, self.mcfg.max_seq_len - plen)

    def _prompt_topk(self, prompt: np.ndarray, slot: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k likeliest tokens at each prompt position given the tokens before it; the first has none."""
        if k > self.mcfg.vocab_size:
            raise UserError(f"topk_prompt_logprobs={k} exceeds the vocabulary ({self.mcfg.vocab_size})")
        n = len(prompt) - 1
        ids = np.zeros((len(prompt), k), np.int32)
        logprobs = np.full((len(prompt), k), protocol.TOPK_MASK_LOGPROB, np.float32)
        if n == 0:
            return ids, logprobs
        tokens, slot_B = self._prompt_row(prompt, slot)
        valid = np.zeros(tokens.shape, bool)
        valid[0, :n] = True
        top_ids, top_lp = self.state.prompt_topk(tokens, slot_B, valid, k)
        ids[1:], logprobs[1:] = top_ids[0, :n], top_lp[0, :n]
        return ids, logprobs

    def _sequence(self, tokens: np.ndarray, logprobs: np.ndarray, mask: np.ndarray, stop_ids: tuple[int, ...],
                  stop_strs: tuple[str, ...]) -> protocol.SampledOutput:
        k = int(mask.sum())
        toks, lps = tokens[:k], logprobs[:k]
        reason: Literal["stop", "length"] = "stop" if k and int(toks[-1]) in stop_ids else "length"
        if stop_strs and self.tokenizer is not None:
            for j in range(1, k + 1):
                text = self.tokenizer.decode([int(t) for t in toks[:j]])
                if any(s in text for s in stop_strs):
                    toks, lps, reason = toks[:j], lps[:j], "stop"
                    break
        return protocol.SampledOutput(tokens=toks, stop_reason=reason, logprobs=lps)

    def _prompt_logprobs(self, prompt: np.ndarray, slot: int) -> np.ndarray:
        """log p(prompt[i] | prompt[:i]) under the sampler's weights; the first token has none (NaN)."""
        n = len(prompt) - 1
        out = np.full(len(prompt), np.nan, np.float32)
        if n == 0:
            return out
        tokens, slot_B = self._prompt_row(prompt, slot)
        packed = losses.pack_rows([losses.Row("cross_entropy", {"target_tokens": prompt[1:],
                                                                "weights": np.zeros(n, np.float32)})],
                                  length=tokens.shape[1], num_rows=tokens.shape[0], vocab_size=self.mcfg.vocab_size)
        lp, _ = self.state.run_pass(tokens, slot_B, packed, False)
        out[1:] = np.asarray(lp)[0, :n]
        return out

    def _prompt_row(self, prompt: np.ndarray, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """A one-prompt batch for the prompt's own predictions: row 0 holds prompt[:-1] on `slot`, bucketed; the
        other rows (data-parallel padding) are empty on the base model."""
        n = len(prompt) - 1
        tokens = np.zeros((self.progs.rows(1), datum_length(self.service, self.mcfg.max_seq_len, n)), np.int32)
        tokens[0, :n] = prompt[:-1]
        slot_B = np.full((tokens.shape[0],), -1, np.int32)
        slot_B[0] = slot
        return tokens, slot_B
