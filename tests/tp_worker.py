"""One tensor-parallel rank outside Ray (``python -m tests.tp_worker RANK WORLD PORT MODEL OUT [MODEL_IMPL]``): the same
``TPWorkerActor`` code path the served TP pools use, one prefill + decode batch, logits saved by rank 0."""

from __future__ import annotations

import sys

import torch


def main(rank: int, world: int, port: int, model: str, out: str, model_impl: str = "auto") -> None:
    from app.pool.tp_executor import TPWorkerActor
    from engine import EngineConfig
    from engine.worker.model_runner import ModelInput

    torch.set_num_threads(1)
    worker = TPWorkerActor(EngineConfig(model=model, block_size=4, num_kv_blocks=32, model_impl=model_impl),
                           rank, world, port)
    worker.load()
    worker.allocate(32)
    prompts = [[5, 9, 33, 71, 100, 2, 8, 64, 13, 200, 17], [250, 3, 3, 90, 42, 7]]
    inp = ModelInput([], [], [], [], [], [0], [])
    block = 1
    for p in prompts:  # prefill both, then one decode token each (positions continue)
        table = list(range(block, block + 4))
        block += 4
        inp.input_ids += p
        inp.positions += list(range(len(p)))
        inp.slot_mapping += [table[i // 4] * 4 + i % 4 for i in range(len(p))]
        inp.block_tables.append(table)
        inp.seq_lens.append(len(p))
        inp.query_start_loc.append(inp.query_start_loc[-1] + len(p))
        inp.logits_indices.append(inp.query_start_loc[-1] - 1)
    first = worker.runner.execute(inp)
    dec = ModelInput([int(first[i].argmax()) for i in range(2)], [len(p) for p in prompts],
                     [t[len(p) // 4] * 4 + len(p) % 4 for t, p in zip(inp.block_tables, prompts)],
                     inp.block_tables, [len(p) + 1 for p in prompts], [0, 1, 2], [0, 1])
    second = worker.runner.execute(dec)
    if rank == 0:
        torch.save(torch.cat([first, second]), out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
