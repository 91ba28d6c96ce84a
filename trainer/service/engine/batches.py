"""The engine's passes: forward/forward_backward requests validated per request, their datums fused into rows and
run in bucketed passes of at most service.max_batch_tokens (the rule: service/passes.py).

`Passes` owns the longest datum a pass holds and the record of how many requests each fused claim held
(observability). It reads the store (completing requests, a stable_reinforce datum's sample records), the slot table
(a batch's slots are pinned while it is assembled) and the device state. It does not hold the models: a request's
model slot comes from the `model_slot` its caller hands `run_forward` (Models.slot), since rebuilding a model
replays passes itself (`replay`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from tinker import types

from trainer.base.config import ModelConfig, ServiceConfig
from trainer.service import losses, protocol, provenance
from trainer.service.device import DeviceState
from trainer.service.engine.common import (
    UserError,
    fail,
    log,
)
from trainer.service.passes import datum_length, datums_per_pass
from trainer.service.slots import Slot, SlotTable
from trainer.service.store import (
    DONE,
    NotFound,
    Request,
    Store,
)


class Accepted(NamedTuple):
    """A forward/forward_backward request that passed validation: its decoded body, its model's slot and one loss
    row per datum (stable_reinforce's carry what their provenance resolved to)."""

    row: Request
    body: protocol.FwdBwdBody
    slot: int
    loss_rows: list[losses.Row]


class Passes:
    """Runs forward/forward_backward requests (see the module docstring). `max_datum`: the longest datum a pass of
    service.max_batch_tokens holds (passes.service_longest_datum)."""

    def __init__(self, store: Store, slots: SlotTable, state: DeviceState, mcfg: ModelConfig, service: ServiceConfig,
                 *, worker_id: str, max_datum: int) -> None:
        self.store = store
        self.slots = slots
        self.state = state
        self.mcfg = mcfg
        self.service = service
        self.progs = state.progs
        self.worker_id = worker_id
        self.max_datum = max_datum
        # Observability (tests read it): requests per fused forward/backward claim, newest last.
        self.fused_sizes: deque[int] = deque(maxlen=1000)

    def warm_up(self) -> None:
        """Run the forward and the forward_backward program of a one-token datum once, on no slot (zero gradients)."""
        n_rows, length = self.progs.rows(1), datum_length(self.service, self.mcfg.max_seq_len, 1)
        packed = losses.pack_rows([losses.Row("cross_entropy", {"target_tokens": np.zeros(1, np.int32),
                                                                "weights": np.zeros(1, np.float32)})],
                                  length=length, num_rows=n_rows, vocab_size=self.mcfg.vocab_size)
        for backward in (False, True):
            self.state.run_pass(np.zeros((n_rows, length), np.int32), np.full((n_rows,), -1, np.int32), packed,
                                backward)

    # -- forward / forward_backward -----------------------------------------------------------------------------

    def run_forward(self, rows: list[Request], model_slot: Callable[[str], Slot]) -> None:
        """Validate each request, fuse the valid ones' datums, run them in bucketed passes, answer each request.
        `model_slot`: a model's slot, found or rebuilt (Models.slot)."""
        accepted: list[Accepted] = []
        try:
            self._validate_forward(rows, accepted, model_slot)
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
                fail(self.store, self.worker_id, row, f"engine error: {e!r}", "server")
            return
        for (row, *_), (logps, row_losses) in zip(accepted, outputs, strict=True):
            result = protocol.encode_forward_backward_output(
                [{"logprobs": lp} for lp in logps], losses.request_metrics(row_losses, slice(None)))
            self.store.complete(row.request_id, result, worker_id=self.worker_id)

    def replay(self, rows: list[Request], index: int) -> None:
        """Run forward_backward requests again on slot `index` for their gradients alone (a model's restore: their
        results were delivered)."""
        bodies = [(r, protocol.decode_forward_backward(r.body)) for r in rows]
        self._fused([Accepted(r, b, index, self._loss_rows(r, b)) for r, b in bodies])

    def _validate_forward(self, rows: list[Request], accepted: list[Accepted],
                          model_slot: Callable[[str], Slot]) -> None:
        for row in rows:
            try:
                body = protocol.decode_forward_backward(row.body)
                total = sum(len(d.tokens) for d in body.data)
                if total > self.service.max_request_tokens:
                    raise UserError(f"the request carries {total} tokens; this server takes at most "
                                    f"{self.service.max_request_tokens} per request (service.max_request_tokens): "
                                    "split it into several forward_backward calls before the optim_step")
                slot = model_slot(row.model_id or "")
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
                fail(self.store, self.worker_id, row, str(e), "user")
            except Exception as e:  # noqa: BLE001 - whatever one request's input does, its batch-mates still run
                log.exception("request %s (%s): validation failed", row.request_id, row.kind)
                fail(self.store, self.worker_id, row, f"engine error while reading the request: {e!r}", "server")

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
