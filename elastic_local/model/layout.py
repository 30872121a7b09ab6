"""Rank-major head layout: how grouped heads are kept resident so every budget is one prefix.

Mamba heads are nested *per group* (a budget keeps the first k heads of each of the G groups) and
attention query heads per KV group. On disk the heads stay group-major (head h belongs to group
h // heads_per_group), the layout every other loader expects. At load the runtime reorders them
rank-major: position j holds rank j // G of group j % G. Then the first k*G positions are exactly the
heads a budget with k heads per group keeps, and every weight of that budget is a contiguous prefix.
"""

from __future__ import annotations

import torch


def rank_major_heads(n_heads: int, n_groups: int, per_group: int | None = None) -> torch.Tensor:
    """File head index for each resident position, keeping the first `per_group` heads of every group."""
    hpg = n_heads // n_groups
    k = hpg if per_group is None else per_group
    ranks = torch.arange(k).repeat_interleave(n_groups)
    groups = torch.arange(n_groups).repeat(k)
    return groups * hpg + ranks


def head_channels(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Channel indices of the given heads, head_dim channels each, in order."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def mamba_rows(heads: torch.Tensor, stored_heads: int, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_proj rows, conv1d rows) that keep the given Mamba heads of a file storing `stored_heads`.

    in_proj's rows are z | x | B | C | dt (SPEC §3): z and x have head_dim rows per head, B and C
    n_groups x state rows that every head keeps, dt one row per head; conv1d's channels are x | B | C."""
    p, bc_rows = cfg.mamba_head_dim, 2 * cfg.n_groups * cfg.ssm_state_size
    n = stored_heads * p
    ch = head_channels(heads, p)
    bc = torch.arange(2 * n, 2 * n + bc_rows)
    return torch.cat([ch, n + ch, bc, 2 * n + bc_rows + heads]), torch.cat([ch, bc - n])
