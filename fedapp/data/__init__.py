"""The data room: what clients train and test on.

``datasets`` loads a dataset once as normalised tensors; ``partitions`` splits it into client
shards (IID, Dirichlet, pathological, two-class, fixed-size) with per-client test sets;
``local_data`` reads a SuperNode's own data folder instead; ``augment`` makes batched
contrastive views; ``setup`` says what a run config means for one experiment: its data,
partition and each client's architecture.
"""
