"""A two-rank Horovod check run by ``horovodrun`` in test_environment.py: one allreduce and one
``hvd.DistributedOptimizer`` step; rank 0 prints the results as JSON."""

import json

import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
model = torch.nn.Linear(2, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
loss = model(torch.full((4, 2), float(hvd.rank() + 1))).sum()
optimizer.zero_grad()
loss.backward()
optimizer.step()
weights = hvd.allgather_object([w.detach().flatten().tolist() for w in model.parameters()])
if hvd.rank() == 0:
    print("RESULT " + json.dumps({"size": hvd.size(), "sum": total, "same_weights": weights[0] == weights[1]}), flush=True)
