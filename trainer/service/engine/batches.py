"""The engine's passes: forward/forward_backward requests validated per request, their datums fused into rows and
run in bucketed passes of at most service.max_batch_tokens (the rule: service/passes.py)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from tinker import types

from trainer.base.config import ServiceConfig
from trainer.service import losses, protocol, provenance
from trainer.service.engine.common import (
    Accepted,
    EnginePart,
    UserError,
    log,
)
from trainer.service.passes import datum_length, datums_per_pass
from trainer.service.programs import EnginePrograms
from trainer.service.store import (
    DONE,
    NotFound,
    Request,
)


class Passes(EnginePart):
    """Part of the Engine (engine/loop.py): the state it reads (store, slots, device state) is the engine's."""

    # The rest of the engine's state this part reads (set in Engine.__init__, engine/loop.py).
    service: ServiceConfig
    progs: EnginePrograms
    worker_id: str
    max_datum: int
    fused_sizes: deque[int]

    # -- forward / forward_backward -----------------------------------------------------------------------------

    def _run_forward(self, rows: list[Request]) -> None:
        """Validate each request, fuse the valid ones' datums, run them in bucketed passes, answer each request."""
        accepted: list[Accepted] = []
        try:
            self._validate_forward(rows, accepted)
        finally:
            self.slots.pinned.clear()
        if not accepted:
            return
        self.fused_sizes.append(len(accepted))
        try:
            outputs = self._fused(accepted)
        except Exception as e:  # noqa: BLE001
            log.exception("forward/backward batch failed")
            for row, *_ in accepted:
                self._fail(row, f"engine error: {e!r}", "server")
            return
        for (row, *_), (logps, row_losses) in zip(accepted, outputs, strict=True):
            result = protocol.encode_forward_backward_output(
                [{"logprobs": lp} for lp in logps], losses.request_metrics(row_losses, slice(None)))
            self.store.complete(row.request_id, result, worker_id=self.worker_id)

    def _validate_forward(self, rows: list[Request], accepted: list[Accepted]) -> None:
        for row in rows:
            try:
                body = protocol.decode_forward_backward(row.body)
                total = sum(len(d.tokens) for d in body.data)
                if total > self.service.max_request_tokens:
                    raise UserError(f"the request carries {total} tokens; this server takes at most "
                                    f"{self.service.max_request_tokens} per request (service.max_request_tokens): "
                                    "split it into several forward_backward calls before the optim_step")
                slot = self._model_slot(row.model_id or "")
                self.slots.pinned.add(slot.index)
                for i, d in enumerate(body.data):
                    if len(d.tokens) > self.max_datum:
                        raise UserError(
                            f"datum {i} has {len(d.tokens)} tokens; this server takes at most {self.max_datum} (the "
                            f"model's context is {self.mcfg.max_seq_len}; a pass holds service.max_batch_tokens = "
                            f"{self.service.max_batch_tokens})")
                    if len(d.tokens) and (d.tokens.min() < 0 or d.tokens.max() >= self.mcfg.vocab_size):
                        raise UserError(f"datum {i}: token ids must be in [0, {self.mcfg.vocab_size})")
                for i, d in enumerate(body.data):
                    targets = d.loss_fn_inputs.get("target_tokens")
                    if targets is not None and len(targets) != len(d.tokens):
                        raise UserError(f"datum {i}: loss_fn_inputs have {len(targets)} positions, model_input has "
                                        f"{len(d.tokens)}")
                # Validates loss names, configs, inputs and provenance: a bad request fails alone.
                loss_rows = self._loss_rows(row, body)
                losses.pack_rows(loss_rows, vocab_size=self.mcfg.vocab_size)
                accepted.append(Accepted(row, body, slot.index, loss_rows))
            except (UserError, NotFound, losses.BadLossInput, losses.UnsupportedLoss, ValueError) as e:
                self._fail(row, str(e), "user")
            except Exception as e:  # noqa: BLE001 - whatever one request's input does, its batch-mates still run
                log.exception("request %s (%s): validation failed", row.request_id, row.kind)
                self._fail(row, f"engine error while reading the request: {e!r}", "server")

    def _loss_rows(self, row: Request, body: protocol.FwdBwdBody) -> list[losses.Row]:
        """One loss row per datum; a stable_reinforce datum's spans are resolved against the sampler's records."""
        if body.loss_fn != "stable_reinforce":
            return [losses.Row(body.loss_fn, d.loss_fn_inputs, body.loss_fn_config) for d in body.data]
        session_id = self.store.model(row.model_id or "").session_id
        spans = [provenance.decode(d.raw, i) for i, d in enumerate(body.data)]
        # Every sample request the datums name, in one read (a cookbook batch names hundreds).
        named = self.store.requests_with_session(row.owner_id, protocol.SAMPLE, provenance.request_ids(spans))
        records: dict[str, provenance.Record] = {}

        def lookup(request_id: str) -> provenance.Record:
            if request_id not in records:
                records[request_id] = self._sample_record(named.get(request_id), session_id, request_id)
            return records[request_id]

        out = []
        for i, (d, datum_spans) in enumerate(zip(body.data, spans, strict=True)):
            targets = d.loss_fn_inputs.get("target_tokens")
            if targets is None:
                raise losses.BadLossInput(f"datum {i} (stable_reinforce): missing loss_fn_inputs ['target_tokens']")
            prov = provenance.resolve(i, d.tokens, targets, datum_spans, lookup)
            out.append(losses.Row(body.loss_fn, d.loss_fn_inputs, body.loss_fn_config, prov))
        return out

    @staticmethod
    def _sample_record(found: tuple[Request, str] | None, session_id: str, request_id: str) -> provenance.Record:
        """The record of a sample request of this owner (`found`: the request and its sampler's session), made with
        record_stability_info in the training model's session."""
        name = f"sequences of request {request_id!r}"
        if found is None:
            raise losses.BadLossInput(f"{name}: no such sample request")
        sample, sampled_in = found
        if sample.status != DONE or sample.result is None:
            raise losses.BadLossInput(f"{name}: not a finished sample request")
        req: types.SampleRequest = protocol.decode_json(protocol.SAMPLE, sample.body)
        if not req.record_stability_info:
            raise losses.BadLossInput(f"{name}: sampled without record_stability_info=True (make the sampling client "
                                      "with record_stability_info=True)")
        if sampled_in != session_id:
            raise losses.BadLossInput(f"{name}: sampled in another session; provenance works only within the "
                                      "session that sampled (sample and train with one ServiceClient)")
        return provenance.sampled_record(req.prompt.to_ints(), sample.result)

    def _fused(self, accepted: list[Accepted]) -> list[tuple[list[np.ndarray], np.ndarray]]:
        """Every datum of every accepted request, grouped by length bucket and backward-or-not, in passes of at most
        max_batch_tokens; returns per request its datums' logprobs and row losses."""
        svc = self.service
        items = []  # (request index, datum index, backward, datum, loss row, slot)
        for r, (_, body, slot, loss_rows) in enumerate(accepted):
            for i, (d, loss_row) in enumerate(zip(body.data, loss_rows, strict=True)):
                items.append((r, i, not body.forward_only, d, loss_row, slot))
        out_lp: list[list[np.ndarray | None]] = [[None] * len(a.body.data) for a in accepted]
        out_loss: list[np.ndarray] = [np.zeros(len(a.body.data)) for a in accepted]
        groups: dict[tuple[bool, int], list[Any]] = {}
        for item in items:
            length = datum_length(svc, self.mcfg.max_seq_len, len(item[3].tokens))
            groups.setdefault((item[2], length), []).append(item)
        for (backward, length), group in sorted(groups.items()):
            per_pass = datums_per_pass(svc, length)
            for start in range(0, len(group), per_pass):
                part = group[start:start + per_pass]
                lp, row_loss = self._pass(part, length, backward)
                for k, (r, i, _, d, *_rest) in enumerate(part):
                    out_lp[r][i] = lp[k, :len(d.tokens)].astype(np.float32)
                    out_loss[r][i] = row_loss[k]
        return [([x for x in lps if x is not None], loss_) for lps, loss_ in zip(out_lp, out_loss, strict=True)]

    def _pass(self, part: list[Any], length: int, backward: bool) -> tuple[np.ndarray, np.ndarray]:
        n_rows = self.progs.rows(len(part))
        packed = losses.pack_rows([loss_row for *_, loss_row, _ in part], length=length, num_rows=n_rows,
                                  vocab_size=self.mcfg.vocab_size)
        tokens = np.zeros((n_rows, length), np.int32)
        slot_B = np.full((n_rows,), -1, np.int32)
        for k, (*_, d, _loss_row, slot) in enumerate(part):
            tokens[k, :len(d.tokens)] = d.tokens
            slot_B[k] = slot
        return self.state.run_pass(tokens, slot_B, packed, backward)
