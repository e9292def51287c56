"""Which layers each virtual pipeline stage (``k = chunk * pp + rank``) holds, from Megatron's layout flags
(:func:`split_layers`), as megatron-core 0.16 and Megatron-LM's argument checks place and refuse them
(``tests/unit/test_stages.py`` compares with an installed megatron-core). The embedding sits on virtual stage 0,
the output layer and the loss on the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ScheduleError

__all__ = ["LAYER_CHARS", "StageLayers", "check_layout_flags", "layout_vpp_size", "parse_layout", "split_layers"]

#: the layout string's layer letters (megatron-core's): embedding, decoder ("transformer") layer, MTP layer, loss
LAYER_CHARS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_REPEAT = re.compile(r"\*(\d+)")


def parse_layout(layout: str) -> tuple[tuple[str, ...], ...]:
    """A layout string as one tuple of layer letters per virtual stage: stages separated by ``|``, ``x*n`` repeats
    a letter (or ``|``), ``(...)*n`` a group (no nesting), commas are cosmetic (``"Ett|(tt|)*2,tL"`` is ``[E t t]
    [t t] [t t] [t L]``)."""
    if not isinstance(layout, str) or not layout:
        raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r} must be a non-empty string such as "
                            f"'Ett|(tt|)*6,tL' (E embedding, t decoder layer, m MTP layer, L loss, | between stages)")
    text = layout.replace(",", "")

    def fail(why: str) -> ScheduleError:
        return ScheduleError(f"pipeline_model_parallel_layout = {layout!r}: {why}; use letters "
                             f"{'/'.join(LAYER_CHARS)} and '|', 'x*n' and '(...)*n' (no nesting)")

    def letters(part: str, at: int) -> str:  # ``part`` (at ``at`` in the text) with its letters' repeats expanded
        out, i = [], 0
        while i < len(part):
            c = part[i]
            if c == "*":
                raise fail(f"'*' at {at + i} repeats nothing")
            if c not in LAYER_CHARS and c != "|":
                raise fail(f"{c!r} at {at + i} is not a layer letter")
            match = _REPEAT.match(part, i + 1)
            out.append(c * (int(match.group(1)) if match else 1))
            i = match.end() if match else i + 1
        return "".join(out)

    out, i = [], 0
    while i < len(text):
        if text[i] != "(":  # letters up to the next group
            j = text.find("(", i)
            j = len(text) if j < 0 else j
            out.append(letters(text[i:j], i))
            i = j
            continue
        close = text.find(")", i)
        if close < 0:
            raise fail(f"'(' at {i} is never closed")
        body = text[i + 1:close]
        if not body or "(" in body:
            raise fail("a group must hold letters and no other group")
        match = _REPEAT.match(text, close + 1)
        if not match:
            raise fail(f"the group '({body})' needs a count, '({body})*n'")
        out.append(letters(body, i + 1) * int(match.group(1)))
        i = match.end()
    return tuple(tuple(stage) for stage in "".join(out).split("|"))


def layout_vpp_size(layout: str, pp_size: int) -> int:
    """The virtual pipeline size a layout implies (its stage count / ``pp_size``), as Megatron derives it."""
    stages = len(parse_layout(layout))
    if stages % pp_size:
        raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r} has {stages} stages, not a multiple of "
                            f"pp_size = {pp_size} (Megatron refuses it); give pp * vpp stages separated by '|'")
    return stages // pp_size


def check_layout_flags(*, pp_size: int, vpp_size: int, decoder_first_pipeline_num_layers: int | None,
                       decoder_last_pipeline_num_layers: int | None, pipeline_model_parallel_layout: str | None,
                       account_for_embedding_in_pipeline_split: bool,
                       account_for_loss_in_pipeline_split: bool) -> None:
    """Refuse what Megatron refuses without knowing ``num_layers`` (:func:`split_layers` checks the rest)."""
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    accounts = account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split
    layout = pipeline_model_parallel_layout
    if layout is not None:
        if first is not None or last is not None or accounts:
            raise ScheduleError(
                f"pipeline_model_parallel_layout = {layout!r} cannot be combined with decoder_first/last_pipeline_"
                f"num_layers ({first}, {last}) or account_for_embedding/loss_in_pipeline_split (Megatron refuses "
                f"it); the layout already places every layer: drop the others")
        stages = parse_layout(layout)
        if pp_size == 1 and len(stages) > 1:
            raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r} has {len(stages)} stages but pp_size "
                                f"= 1 (Megatron's interleaved schedule needs pipeline parallelism); pass the "
                                f"pipeline-parallel size, or a layout of one stage")
        implied = layout_vpp_size(layout, pp_size)
        if implied != vpp_size:
            raise ScheduleError(
                f"pipeline_model_parallel_layout = {layout!r} has {implied * pp_size} stages = pp_size {pp_size} x "
                f"vpp {implied}, but vpp_size = {vpp_size}; pass vpp_size = {implied} (Megatron derives it from "
                f"the layout)")
        flat = [c for stage in stages for c in stage]
        if flat.count("E") != 1 or flat[0] != "E":
            raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r} must start with the embedding 'E' and "
                                f"hold it once (Megatron requires it)")
        if flat.count("L") != 1 or flat[-1] != "L":
            raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r} must end with the loss 'L' and hold "
                                f"it once (Megatron requires it)")
        if "m" in flat and "t" in flat[flat.index("m"):]:
            raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r}: decoder layers 't' must come before "
                                f"the MTP layers 'm' (Megatron requires it)")
        mtp_stages = [k for k, stage in enumerate(stages) if "m" in stage]
        if len(mtp_stages) > 1 or any(k < (vpp_size - 1) * pp_size for k in mtp_stages):
            raise ScheduleError(f"pipeline_model_parallel_layout = {layout!r}: all MTP layers 'm' must sit in one "
                                f"virtual stage, the last model chunk of its rank (Megatron requires it)")
        return
    if (first is not None or last is not None) and accounts:
        raise ScheduleError(
            f"decoder_first/last_pipeline_num_layers ({first}, {last}) cannot be combined with account_for_embedding/"
            f"loss_in_pipeline_split (Megatron refuses it); move layers with one or the other")
    for name, value in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
        if value is None:
            continue
        if pp_size == 1:
            raise ScheduleError(f"{name} = {value} needs pipeline parallelism (pp_size = 1 has one stage, which "
                                f"holds every layer); drop it or pass the pipeline-parallel size")
        if value % vpp_size:
            raise ScheduleError(f"{name} = {value} must be a multiple of vpp_size = {vpp_size} (Megatron splits a "
                                f"rank's layers evenly over its model chunks); pass a multiple of {vpp_size}")


@dataclass(frozen=True)
class StageLayers:
    """What each virtual stage holds: decoder layers (numbered in virtual-stage order) and MTP layers."""

    pp_size: int
    vpp_size: int
    decoder: tuple[int, ...]  # decoder layers per virtual stage
    mtp: tuple[int, ...]  # MTP layers per virtual stage (only from a layout)

    @property
    def first_layer(self) -> tuple[int, ...]:
        """Id of each virtual stage's first decoder layer (layers are numbered in virtual-stage order)."""
        out, n = [], 0
        for count in self.decoder:
            out.append(n)
            n += count
        return tuple(out)


def split_layers(num_layers: int, *, pp_size: int, vpp_size: int = 1,
                 decoder_first_pipeline_num_layers: int | None = None,
                 decoder_last_pipeline_num_layers: int | None = None,
                 pipeline_model_parallel_layout: str | None = None,
                 account_for_embedding_in_pipeline_split: bool = False,
                 account_for_loss_in_pipeline_split: bool = False) -> StageLayers:
    """Megatron's split of ``num_layers`` decoder layers over the virtual stages, by a layout string, the first/last
    rank's counts with the rest even, or evenly (the embedding and the loss counted as layers where asked);
    refuses what Megatron refuses."""
    check_layout_flags(pp_size=pp_size, vpp_size=vpp_size,
                       decoder_first_pipeline_num_layers=decoder_first_pipeline_num_layers,
                       decoder_last_pipeline_num_layers=decoder_last_pipeline_num_layers,
                       pipeline_model_parallel_layout=pipeline_model_parallel_layout,
                       account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
                       account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split)
    pp, vpp = pp_size, vpp_size
    if pipeline_model_parallel_layout is not None:
        stages = parse_layout(pipeline_model_parallel_layout)
        decoder = tuple(stage.count("t") for stage in stages)
        if sum(decoder) != num_layers:
            raise ScheduleError(f"pipeline_model_parallel_layout = {pipeline_model_parallel_layout!r} holds "
                                f"{sum(decoder)} decoder layers 't' but num_layers = {num_layers}; make them agree")
        return StageLayers(pp, vpp, decoder, tuple(stage.count("m") for stage in stages))
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        middle_layers, middle_ranks = num_layers, pp
        for value in (first, last):
            if value is not None:
                middle_layers -= value
                middle_ranks -= 1
        given = f"decoder_first/last_pipeline_num_layers = {first}/{last} with num_layers = {num_layers}"
        if middle_layers < 0 or bool(middle_layers) != bool(middle_ranks):
            raise ScheduleError(f"{given} leave {middle_layers} layers for {middle_ranks} middle pipeline ranks "
                                f"(Megatron refuses it); the first, last and middle layers must add up to num_layers")
        if middle_ranks and middle_layers % (middle_ranks * vpp):
            raise ScheduleError(f"{given} leave {middle_layers} layers for {middle_ranks} middle ranks x {vpp} "
                                f"chunks, not an even split (Megatron refuses it); adjust the first/last counts")
        per_rank = [middle_layers // middle_ranks if middle_ranks else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        decoder = tuple(per_rank[k % pp] // vpp for k in range(pp * vpp))
        return StageLayers(pp, vpp, decoder, (0,) * (pp * vpp))
    total = num_layers + account_for_embedding_in_pipeline_split + account_for_loss_in_pipeline_split
    if total % (pp * vpp):
        counted = "" if total == num_layers else f" (num_layers {num_layers} plus the embedding and/or loss)"
        raise ScheduleError(f"{total} layers{counted} do not split evenly over pp_size {pp} x vpp_size {vpp} = "
                            f"{pp * vpp} model chunks (Megatron refuses it); move layers with "
                            f"decoder_first/last_pipeline_num_layers or pipeline_model_parallel_layout")
    decoder = [total // (pp * vpp)] * (pp * vpp)
    if account_for_embedding_in_pipeline_split:
        decoder[0] -= 1
    if account_for_loss_in_pipeline_split:
        decoder[-1] -= 1
    if min(decoder) < 0:
        raise ScheduleError(f"account_for_embedding/loss_in_pipeline_split with {num_layers} layers over {pp * vpp} "
                            f"model chunks leaves a chunk without room for the embedding or the loss (Megatron "
                            f"refuses it); use fewer chunks")
    return StageLayers(pp, vpp, tuple(decoder), (0,) * (pp * vpp))
