"""A datum's provenance (tinker 0.38 `Datum.with_provenance`) checked against what the sampler recorded.

A sample request made with `record_stability_info=True` is its own record: its row keeps the body (the prompt) and
the result (every sequence's tokens and log-probs), and sequence i of request R is named "R.i"
(`protocol.sequence_ids`), so a sequence id finds its record with one read and no second copy of the data. Rows are
kept as long as the database keeps requests (the store prunes none), longer than the day Tinker documents.

Spans (tinker/types/provenance_spans.py) tile a datum's fields in order: `model_input_spans` its input tokens,
`loss_fn_input_spans` its target_tokens. A PromptProvenanceSpan claims positions [offset, offset + length) of the
named sequence's request prompt, a SampledProvenanceSpan those of its sampled tokens. Each claim is checked token by
token, so a datum cannot borrow another sequence's log-probs. What stable_reinforce needs comes out as
`losses.Provenance`: the sampler's log-prob at each loss position a sampled span covers, and which positions those are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from trainer.service.losses import NEEDS_PROVENANCE, BadLossInput, Provenance


@dataclass(frozen=True)
class Span:
    sampled: bool  # a SampledProvenanceSpan; else a PromptProvenanceSpan
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Spans:
    model_input: list[Span]
    loss_fn_inputs: list[Span]


@dataclass(frozen=True)
class Record:
    """One recorded sample request: its prompt and, per sequence, the sampled tokens and their log-probs."""

    prompt: np.ndarray
    tokens: Sequence[np.ndarray]
    logprobs: Sequence[np.ndarray]


def sampled_record(prompt: Sequence[int], result: bytes) -> Record:
    """The record of a finished sample request: its prompt and its result (protocol.encode_sample_response)."""
    msg = pb.SampleResponse()
    msg.ParseFromString(result)
    return Record(prompt=np.asarray(prompt, np.int64),
                  tokens=[np.frombuffer(s.tokens, np.int32) for s in msg.sequences],
                  logprobs=[np.frombuffer(s.logprobs, np.float32) for s in msg.sequences])


Lookup = Callable[[str], Record]  # a sample request id -> its record (raises BadLossInput when there is none)


def _span(msg: pb.ProvenanceSpan, where: str) -> Span:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise BadLossInput(f"{where}: a provenance span names neither prompt_tokens nor sampled_tokens")
    inner = getattr(msg, kind)
    if not inner.sequence_id or inner.offset < 0 or inner.length < 0:
        raise BadLossInput(f"{where}: a provenance span needs a sequence_id, offset >= 0 and length >= 0")
    return Span(kind == "sampled_tokens", inner.sequence_id, int(inner.offset), int(inner.length))


def decode(raw: pb.Datum, index: int) -> Spans | None:
    """The datum's spans, or None when it carries none (the SDK sends both lists or neither)."""
    if not raw.model_input_spans and not raw.loss_fn_input_spans:
        return None
    where = f"datum {index}"
    return Spans([_span(m, where) for m in raw.model_input_spans], [_span(m, where) for m in raw.loss_fn_input_spans])


def request_ids(spans: Sequence[Spans | None]) -> set[str]:
    """The sample requests some datums' spans name (ids this server could not have handed out are left out: resolve
    refuses them)."""
    out = set()
    for datum in spans:
        for span in (datum.model_input + datum.loss_fn_inputs) if datum is not None else ():
            try:
                out.add(parse_sequence_id(span.sequence_id)[0])
            except ValueError:
                continue
    return out


def parse_sequence_id(sequence_id: str) -> tuple[str, int]:
    """"R.i" -> (R, i); a ValueError for anything this service did not hand out."""
    request_id, _, index = sequence_id.rpartition(".")
    if not request_id or not index.isdigit():
        raise ValueError(f"sequence_id {sequence_id!r} is not one this server handed out")
    return request_id, int(index)


def resolve(index: int, tokens: np.ndarray, targets: np.ndarray, spans: Spans | None, lookup: Lookup) -> Provenance:
    """Check every span of one datum against its record; the sampler's log-probs at the sampled loss positions."""
    where = f"datum {index}"
    if spans is None:
        raise BadLossInput(f"{where}: {NEEDS_PROVENANCE}")
    records: dict[str, Record] = {}

    def source(span: Span) -> tuple[np.ndarray, np.ndarray | None]:
        """The recorded tokens (and log-probs, for a sampled span) the span claims."""
        try:
            request_id, i = parse_sequence_id(span.sequence_id)
        except ValueError as e:
            raise BadLossInput(f"{where}: {e}") from None
        if request_id not in records:
            records[request_id] = lookup(request_id)
        record = records[request_id]
        if i >= len(record.tokens):
            raise BadLossInput(f"{where}: sequence_id {span.sequence_id!r}: its request sampled {len(record.tokens)}")
        full, lps = (record.tokens[i], record.logprobs[i]) if span.sampled else (record.prompt, None)
        end = span.offset + span.length
        if end > len(full):
            what = "sampled tokens" if span.sampled else "prompt tokens"
            raise BadLossInput(f"{where}: a span claims {what} [{span.offset}, {end}) of {span.sequence_id!r}, "
                               f"which has {len(full)}")
        return full[span.offset:end], (lps[span.offset:end] if lps is not None else None)

    logprobs = np.zeros(len(targets), np.float32)
    sampled = np.zeros(len(targets), bool)
    for field, values, tiling in (("model_input", tokens, spans.model_input),
                                  ("loss_fn_inputs", targets, spans.loss_fn_inputs)):
        covered = sum(s.length for s in tiling)
        if covered != len(values):
            raise BadLossInput(f"{where}: {field} spans cover {covered} positions, the field has {len(values)}")
        if len(tiling) > len(values) + 1:
            raise BadLossInput(f"{where}: {len(tiling)} {field} spans for {len(values)} positions")
        at = 0
        for span in tiling:
            claimed, lps = source(span)
            if not np.array_equal(np.asarray(values[at:at + span.length], np.int64), claimed.astype(np.int64)):
                raise BadLossInput(f"{where}: {field} positions [{at}, {at + span.length}) are not the tokens "
                                   f"{span.sequence_id!r} recorded there")
            if field == "loss_fn_inputs" and lps is not None:
                logprobs[at:at + span.length] = lps
                sampled[at:at + span.length] = True
            at += span.length
    return Provenance(logprobs=logprobs, sampled=sampled)
