"""Mimi's split residual vector quantizer: 1 semantic level + up to 31 acoustic levels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Codebook(nn.Module):
    """One RVQ level. Centroids are embedding_sum / usage, computed once after loading."""

    def __init__(self, bins: int, dim: int):
        super().__init__()
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        self.register_buffer("cluster_usage", torch.ones(bins))
        self.register_buffer("_initialized", torch.ones(1))
        self.register_buffer("centroids", torch.zeros(bins, dim), persistent=False)
        # [c, 1, |c|^2]: the centroid half of torch.cdist's matrix-product distance, kept
        # so that each lookup does not recompute it.
        self.register_buffer("augmented", torch.zeros(bins, dim + 2), persistent=False)

    def refresh(self) -> None:
        # Assigned, not copied into: a model built on the meta device gets real buffers here.
        self.centroids = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        norms = self.centroids.pow(2).sum(-1, keepdim=True)
        self.augmented = torch.cat([self.centroids, torch.ones_like(norms), norms], dim=-1)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] -> codes [N]. The same arithmetic as the reference's torch.cdist
        # (|x|^2 + |c|^2 - 2 x.c as one product, clamped, square-rooted), first index on ties,
        # so that near-ties resolve exactly as in the reference.
        norms = x.pow(2).sum(-1, keepdim=True)
        query = torch.cat([x.mul(-2), norms, torch.ones_like(norms)], dim=-1)
        distances = torch.matmul(query[None], self.augmented[None].transpose(-2, -1))[0]
        return distances.clamp_min_(0).sqrt_().argmin(dim=-1)


class ResidualVQ(nn.Module):
    def __init__(self, levels: int, bins: int, dim: int, input_dim: int, output_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(input_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, output_dim, 1, bias=False)
        self.codebooks = nn.ModuleList(Codebook(bins, dim) for _ in range(levels))

    def encode(self, latent: torch.Tensor, levels: int) -> torch.Tensor:
        # latent: [B, C, F] -> codes [B, levels, F]
        B, _, Fr = latent.shape
        residual = self.input_proj(latent).transpose(1, 2).reshape(B * Fr, -1)
        codes = []
        for codebook in self.codebooks[:levels]:
            level_codes = codebook.nearest(residual)
            residual = residual - F.embedding(level_codes, codebook.centroids)
            codes.append(level_codes.view(B, Fr))
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, K, F] -> [B, output_dim, F]; the 256-d vectors are summed, then projected
        total = torch.zeros((), device=codes.device)
        for level, codebook in enumerate(self.codebooks[:codes.shape[1]]):
            total = total + F.embedding(codes[:, level], codebook.centroids)
        return self.output_proj(total.transpose(1, 2))


class SplitRVQ(nn.Module):
    def __init__(self, *, dimension: int, n_q: int, bins: int, input_dimension: int,
                 output_dimension: int, **_: object):
        super().__init__()
        self.total_codebooks = n_q
        self.rvq_first = ResidualVQ(1, bins, dimension, input_dimension, output_dimension)
        self.rvq_rest = ResidualVQ(n_q - 1, bins, dimension, input_dimension, output_dimension)

    def refresh(self) -> None:
        for module in self.modules():
            if isinstance(module, Codebook):
                module.refresh()

    def encode(self, latent: torch.Tensor, num_codebooks: int) -> torch.Tensor:
        # The acoustic levels quantize a projection of the same latent, not the semantic residual.
        codes = self.rvq_first.encode(latent, 1)
        if num_codebooks > 1:
            codes = torch.cat([codes, self.rvq_rest.encode(latent, num_codebooks - 1)], dim=1)
        return codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        latent = self.rvq_first.decode(codes[:, :1])
        if codes.shape[1] > 1:
            latent = latent + self.rvq_rest.decode(codes[:, 1:])
        return latent
