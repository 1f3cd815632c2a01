"""The token embedding split by vocabulary rows over the tensor-parallel ranks.

Owns the lookup only: a rank looks up the ids it holds, zeros the rows of the others, and
one all-reduce gives every rank the full embeddings (exact: each row is one rank's value
plus zeros). Which rows a rank holds is ``sharding``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_common.model.layers.linear import Embedding
from engine_common.parallel.group import TensorParallel


class VocabParallelEmbedding(Embedding):
    """Rows ``[rank * rows, (rank + 1) * rows)`` of the table, ``rows`` per rank."""

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel):
        super().__init__(rows, hidden_size, dtype, device)
        self.parallel = parallel
        self.first = parallel.rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.parallel.all_reduce(out)
