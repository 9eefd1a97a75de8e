"""`SyncBatchNorm`: batch normalisation whose statistics cover the whole global batch.

Forward: each rank computes its count, mean and sum of squared deviations per channel; one
allgather of those (`sync_batch_norm.stats.<C>`) lets every rank merge them exactly (Chan's
parallel variance, numerically stable). Backward: one allreduce (Sum) of `sum(dy)` and
`sum(dy * (x - mean))` (`sync_batch_norm.grad.<C>`) gives the input gradient of BN over the
global batch; weight and bias gradients stay local (DistributedOptimizer averages them).

Written with plain tensor ops, so it runs on CPU (Horovod needed CUDA) and on any device.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from collective import ProcessSet, ReduceOp, global_process_set, rank

from .ops import allgather_async, allreduce_async, process_set_size, synchronize

__all__ = ["SyncBatchNorm"]


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _one_value_text(x: torch.Tensor, counts: torch.Tensor, ps: ProcessSet) -> str:
    """torch.nn.BatchNorm's text for a batch of one value per channel, here over the ranks."""
    per_rank = [int(n) for n in counts.tolist()]
    ranks = ps.ranks if ps.ranks is not None else list(range(len(per_rank)))
    who = ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, per_rank))
    return (f"Expected more than 1 value per channel when training, got input size "
            f"{list(x.shape)} on rank {rank()}, and 1 value per channel over the "
            f"{len(per_rank)} ranks of the process set ({who}): SyncBatchNorm's batch "
            "statistics cover all of them, and the variance of one value is undefined. Give "
            "the ranks more than 1 value per channel in all, or call the layer in eval mode.")


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                ps: ProcessSet) -> torch.Tensor:
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        sd = _stats_dtype(x)
        xf = x.to(sd)
        count = x.numel() // c if c else 0
        if count:
            mean = xf.mean(dims)
            m2 = (xf - mean.view(shape)).pow(2).sum(dims)
        else:
            mean = torch.zeros(c, dtype=sd, device=x.device)
            m2 = torch.zeros(c, dtype=sd, device=x.device)
        local = torch.cat([torch.tensor([float(count)], dtype=sd, device=x.device), mean, m2])
        gathered = synchronize(allgather_async(local.view(1, -1).contiguous(),
                                               f"sync_batch_norm.stats.{c}", ps))
        counts, means, m2s = gathered[:, 0], gathered[:, 1:1 + c], gathered[:, 1 + c:]
        total = counts.sum()
        if total <= 0:
            raise ValueError("SyncBatchNorm got an empty batch on every rank")
        if total == 1:  # every rank gathered the same counts: all raise, none waits
            raise ValueError(_one_value_text(x, counts, ps))
        g_mean = (counts.unsqueeze(1) * means).sum(0) / total
        g_m2 = m2s.sum(0) + (counts.unsqueeze(1) * (means - g_mean).pow(2)).sum(0)
        var = g_m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            unbiased = g_m2 / (total - 1) if total > 1 else var
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype),
                                                     alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        xhat = (xf - g_mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(sd).view(shape)
        if bias is not None:
            y = y + bias.to(sd).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total, ctx.ps, ctx.has_bias, ctx.in_dtype = total, ps, bias is not None, x.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable  # its saved tensors carry no graph: a second derivative would be wrong
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        xhat, invstd, weight = ctx.saved_tensors
        c = xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        shape = [1, c] + [1] * (xhat.dim() - 2)
        dyf = dy.to(xhat.dtype)
        sum_dy = dyf.sum(dims)
        sum_dy_xhat = (dyf * xhat).sum(dims)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else dy.dtype) \
            if ctx.has_bias else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), None,
                                               f"sync_batch_norm.grad.{c}", ReduceOp.SUM,
                                               1.0, 1.0, ctx.ps))
            mean_dy = (both[:c] / ctx.total).view(shape)
            mean_dy_xhat = (both[c:] / ctx.total).view(shape)
            scale = invstd.view(shape)
            if weight is not None:
                scale = scale * weight.to(xhat.dtype).view(shape)
            grad_input = ((dyf - mean_dy - xhat * mean_dy_xhat) * scale).to(ctx.in_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for `torch.nn.BatchNorm{1,2,3}d` that normalises over the global batch.

    In training mode with more than one rank in the process set, statistics are merged across
    ranks; otherwise (eval mode, or one rank) it is plain batch norm.

    Args:
        num_features: channels (dim 1 of the input).
        eps, momentum, affine, track_running_stats: as `torch.nn.BatchNorm2d`.
        process_set: the ranks whose batches are normalised together (ringvod addition).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Raises:
            ValueError: input with fewer than 2 dimensions; in training mode, 1 value per
                channel over all the process set's ranks (raised on every rank).
        """
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        # As torch.nn.SyncBatchNorm: only training mode synchronises.
        if not self.training or process_set_size(self.process_set) == 1:
            return torch.nn.functional.batch_norm(
                input, self.running_mean if not self.training or self.track_running_stats
                else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch_stats, momentum, self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, momentum, self.process_set)
