"""Top-layer heads' drafting with one host sync per call, for accelerators.

`TopDraftHeads.draft` and `draft_trees` decide on the host after every head step (stop the
chain, pick the frontier), which costs one device->host sync per step: nothing on a CPU,
where early stops save real work, but a stall of the launch queue per draft token on a
GPU. The functions here run every step on the device with masks instead of branches
(a step below its threshold still runs, its nodes masked out), keep the tree's frontier
with a stable sort, and bring all steps' results to the host in one transfer. They return
exactly what the host-side versions return for the same head outputs; tests compare both.
"""

from __future__ import annotations

import torch

from .top import DraftNode, TopDraftHeads, likeliest_first


def _stop_table(stop_tokens, device) -> torch.Tensor:
    """The sequences' stop sets as one [B, M] tensor, padded with -1 (no token id)."""
    width = max([len(s) for s in stop_tokens] + [1])
    table = torch.full((len(stop_tokens), width), -1, dtype=torch.long)
    for b, stops in enumerate(stop_tokens):
        table[b, : len(stops)] = torch.tensor(sorted(stops), dtype=torch.long)
    return table.to(device)


@torch.no_grad()
def draft_chain_on_device(heads: TopDraftHeads, final_hidden: torch.Tensor, token: int, max_tokens: int,
                          thresholds: list[float]) -> list[tuple[int, float, int]]:
    """`heads.draft` with one host sync: every step runs, the chain is cut on the host at
    the first step whose confidence is below its threshold."""
    steps = min(max_tokens, len(heads.steps))
    if steps <= 0:
        return []
    h = final_hidden.reshape(1, -1)
    prev = torch.tensor([token], device=h.device)
    found = []
    for i in range(steps):
        h, logits = heads.step_logits(i, h, prev)
        conf, index = torch.softmax(logits.float(), dim=-1)[0].max(dim=-1)
        prev = heads.vocab_ids[index].reshape(1)
        found.append(torch.stack([conf.double(), prev[0].double()]))
    out = []
    for i, (conf, tok) in enumerate(torch.stack(found).tolist()):
        if conf < thresholds[i]:
            break
        out.append((int(tok), conf, i))
    return out


@torch.no_grad()
def draft_trees_on_device(heads: TopDraftHeads, final_hidden: torch.Tensor, tokens: list[int], depths: list[int],
                          thresholds: list[float], children: int, beam: int, min_prob: float,
                          stop_tokens: list) -> list[list[DraftNode]]:
    """`heads.draft_trees` with one host sync. Every sequence keeps `beam` frontier rows
    after the first step (invalid rows masked), so each step has a fixed shape."""
    depths = [min(d, len(heads.steps)) for d in depths]
    n_seq, n_steps = len(tokens), max(depths, default=0)
    if n_steps == 0:
        return [[] for _ in tokens]
    device = final_hidden.device
    k = min(children, heads.lm_rows.shape[0])
    depth_of = torch.tensor(depths, device=device)
    stops = _stop_table(stop_tokens, device)
    first_child = torch.arange(k, device=device) == 0

    # the rows of a step: one per sequence at step 0, then `beam` per sequence
    h = final_hidden.reshape(n_seq, -1)
    step_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
    owner = torch.arange(n_seq, device=device)
    valid = depth_of > 0
    path = torch.ones(n_seq, dtype=torch.float64, device=device)  # the row's path probability
    on_chain = torch.ones(n_seq, dtype=torch.bool, device=device)
    source = torch.full((n_seq,), -1, dtype=torch.long, device=device)  # grid cell of the row's node
    records = []
    for step in range(n_steps):
        h, logits = heads.step_logits(step, h, step_tokens)
        top_p, top_i = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        top_tokens = heads.vocab_ids[top_i]
        paths = path[:, None] * top_p.double()  # [rows, k], as the host's float products
        chain = on_chain[:, None] & first_child
        expand = valid & ~(top_p[:, 0] < thresholds[step])
        # children are sorted: the first one off the chain under min_prob ends the row's
        failed = ~chain & (paths < min_prob)
        node = expand[:, None] & (failed.cumsum(-1) == 0)
        records.append(torch.cat([top_tokens.double(), paths, node.double(), source[:, None].double()], -1))
        if step + 1 == n_steps:
            break
        stopped = (top_tokens[:, :, None] == stops[owner][:, None, :]).any(-1)
        grows = node & ~stopped & (step + 1 < depth_of[owner])[:, None]
        cells = h.shape[0] // n_seq * k  # each sequence's grid of (row, child) cells
        keys = torch.where(grows, paths, torch.full_like(paths, -1.0)).reshape(n_seq, cells)
        if cells < beam:  # a frontier wider than the grid: padded with cells never taken
            keys = torch.cat([keys, keys.new_full((n_seq, beam - cells), -1.0)], 1)
        # a stable sort keeps equal paths in the host's order (row, then child)
        order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :beam]
        taken = torch.gather(keys, 1, order) >= 0.0
        cell = (torch.arange(n_seq, device=device)[:, None] * cells + order.clamp(max=cells - 1)).reshape(-1)
        row, child = cell // k, cell % k
        h = h[row]
        step_tokens = top_tokens[row, child]
        path = paths[row, child]
        on_chain = chain[row, child]
        valid = taken.reshape(-1)
        source = torch.where(valid, cell, torch.full_like(cell, -1))
        owner = torch.arange(n_seq, device=device).repeat_interleave(beam)
    return _nodes_from_records([r.tolist() for r in _one_transfer(records)], n_seq, k)


def _one_transfer(records: list[torch.Tensor]) -> list[torch.Tensor]:
    """The steps' records on the host after a single device->host copy."""
    return list(torch.cat(records).cpu().split([r.shape[0] for r in records]))


def _nodes_from_records(records: list[list[list[float]]], n_seq: int, k: int) -> list[list[DraftNode]]:
    """The trees the host-side drafting builds, from each step's rows: k tokens, k path
    probabilities, k node flags and the grid cell of the row's own node (-1 at step 0)."""
    nodes: list[list[DraftNode]] = [[] for _ in range(n_seq)]
    index_of_cell: dict[int, int] = {}  # the previous step's grid cell -> node index
    for step, rows in enumerate(records):
        cells: dict[int, int] = {}
        rows_per_seq = len(rows) // n_seq
        for r, values in enumerate(rows):
            b = r // rows_per_seq
            source = int(values[3 * k])
            if step > 0 and source < 0:
                continue  # a frontier slot left empty
            parent = index_of_cell[source] if step > 0 else -1
            parent_on_chain = parent < 0 or nodes[b][parent].on_chain
            for c in range(k):
                if values[2 * k + c] == 0.0:
                    continue
                nodes[b].append(DraftNode(parent, int(values[c]), values[k + c], step,
                                          parent_on_chain and c == 0))
                cells[r * k + c] = len(nodes[b]) - 1
        index_of_cell = cells
    return [likeliest_first(found) for found in nodes]
