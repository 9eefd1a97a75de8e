"""`horovod.torch.elastic.sampler`: `ElasticSampler`, a `DistributedSampler` that resumes
mid-epoch after an elastic reset."""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch
import torch.utils.data

import collective

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """A `DistributedSampler` that resumes mid-epoch: after a reset, the samples already
    processed (as recorded by `record_batch`) are skipped and the rest is split over the new
    world.

    Args:
        dataset: the dataset (only its length is used).
        shuffle: permute the indices with `seed + epoch`.
        seed: the shuffle seed (the same on every rank).

    Example:
        >>> sampler = hvd.elastic.ElasticSampler(dataset)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> for batch_idx, batch in enumerate(loader):
        ...     ...
        ...     sampler.record_batch(batch_idx, 32)
        >>> sampler.set_epoch(epoch + 1)   # at the end of the epoch
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch `epoch` with nothing processed (call it at the end of an epoch)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank processed one more batch of `batch_size` samples."""
        del batch_idx
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-reads rank and size and recomputes this rank's share of the unprocessed samples."""
        self.num_replicas = collective.size() if collective.is_initialized() else 1
        self.rank = collective.rank() if collective.is_initialized() else 0
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:  # pad with the first ones, as DistributedSampler
            padded += self.remaining_indices[:self.total_size - len(padded)]
        self.indices = padded

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
