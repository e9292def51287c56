"""One micro-batch as tensors: its samples packed as THD, one row ``[1, T]`` plus where each sample starts.

As slime's ``get_batch`` packs them: the samples' tokens concatenated into one row, and
``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_kv=[0, L0, L0+L1, ...], max_seqlen_q=max_seqlen_kv=max L)``
for the attention, which runs causally within each sample (:class:`slime_ext.training.thd_attention.
ThdDotProductAttention` here, TransformerEngine's on a TE host). Position ids restart at 0 for every sample, so each
sample sees exactly what it would see alone. The row is as long as the micro-batch's tokens (no padding: slime
pads the row to a multiple of 128 x TP as one more segment, which only TE's kernels want); under pipeline
parallelism Megatron exchanges the shape per micro-batch (``variable_seq_lengths``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

#: the fields a micro-batch needs (``DataIterator.get_next`` keys)
BATCH_KEYS = ("tokens", "total_lengths", "response_lengths", "loss_masks", "advantages", "sample_indices")


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [samples + 1] int32: sample i is tokens[0, cu_seqlens[i]:cu_seqlens[i + 1]]
    max_seqlen: int
    #: per response token (concatenated over samples): the logit position that predicts it, its id, its mask
    #: and its sample's advantage
    logit_positions: torch.Tensor  # [R] int64
    targets: torch.Tensor  # [R] int64
    loss_mask: torch.Tensor  # [R] float32
    advantages: torch.Tensor  # [R] float32
    response_lengths: list[int]
    sample_ids: list[int] | None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def packed_seq_params(self):
        """megatron-core's ``PackedSeqParams`` for this row (THD, self-attention: the same segments for Q and KV)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def pack_micro_batch(batch: dict, *, max_positions: int | None = None, device: torch.device | str = "cpu"
                     ) -> PackedBatch:
    """Pack ``DataIterator.get_next(BATCH_KEYS)`` output into tensors on ``device``."""
    tokens, totals = batch["tokens"], batch["total_lengths"]
    responses, masks, advantages = batch["response_lengths"], batch["loss_masks"], batch["advantages"]
    if not tokens:
        raise ValueError("an empty micro-batch reached the model; the schedule must not contain empty micro-batches")
    flat, positions, logit_pos, targets, mask, adv = [], [], [], [], [], []
    offset = 0
    for i, (toks, total, resp) in enumerate(zip(tokens, totals, responses)):
        if len(toks) != total or not 0 < resp < total or len(masks[i]) != resp:
            raise ValueError(f"sample {i} of the micro-batch: tokens/total_length/response_length/loss_mask "
                             f"disagree ({len(toks)}, {total}, {resp}, {len(masks[i])})")
        if max_positions is not None and total > max_positions:
            raise ValueError(f"a sample has total_length={total} > max_position_embeddings={max_positions}; raise "
                             f"--seq-length/--max-position-embeddings or truncate the rollout")
        flat.extend(toks)
        positions.extend(range(total))
        first = offset + total - resp  # first response token in the packed row
        logit_pos.extend(range(first - 1, offset + total - 1))
        targets.extend(toks[total - resp:])
        mask.extend(masks[i])
        adv.extend([float(advantages[i])] * resp)
        offset += total
    return PackedBatch(
        tokens=torch.tensor(flat, dtype=torch.int64, device=device)[None],
        position_ids=torch.tensor(positions, dtype=torch.int64, device=device)[None],
        cu_seqlens=torch.tensor([0, *itertools.accumulate(totals)], dtype=torch.int32, device=device),
        max_seqlen=int(max(totals)),
        logit_positions=torch.tensor(logit_pos, dtype=torch.int64, device=device),
        targets=torch.tensor(targets, dtype=torch.int64, device=device),
        loss_mask=torch.tensor(mask, dtype=torch.float32, device=device),
        advantages=torch.tensor(adv, dtype=torch.float32, device=device),
        response_lengths=list(responses),
        sample_ids=None if batch.get("sample_indices") is None else list(batch["sample_indices"]),
    )
