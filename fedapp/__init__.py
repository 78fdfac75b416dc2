"""fedapp: model-heterogeneous federated learning on Flower, in rooms by role.

Rooms, low to high (a module imports only its own room or lower ones; ``tests/test_layout.py``
checks it)::

    client_models        the heterogeneous model zoo (feature extractor g + linear head h)
    fedapp.config        the run config: every setting, its default and its validation
    fedapp.seeding       derive_seed / isolated_rng: every random stream keyed by its purpose
    fedapp.data          datasets (tensors), partitions, a node's own data, augmentations, and
                         setup: what a run config means for one experiment (data, partition,
                         each client's architecture)
    fedapp.runtime       what every method builds on: the client base (FedClient), the Strategy
                         base (FedStrategy), the payload wire format, local training, aggregation
                         maths, per-class statistics, checkpoints, results, client speeds
    strategies           one folder per method (FedGH, Felo/Velo, CompFL, FedClassAvg, FedHe, the
                         baselines, ...): its card without torch (its own settings, its recipe,
                         its registration) and its maths, on the runtime's bases
    fedapp.loops         the server loops that are not Flower's synchronous rounds: asynchronous,
                         device-to-device relays (walk, gossip) over a topology, their Grid I/O
    fedapp.server_app    the Flower ServerApp and ClientApp entry points
    fedapp.client_app
    fedapp.cli           the ``fedapp`` command: run, compare, settings, methods, models, deploy,
                         and the Flower processes they start and stop

One synchronous round, from the top:

1. ``fedapp.server_app`` parses the run config (``strategies.load_config``), checks data and
   partition (``fedapp.data.setup.prepare``), opens the results folder
   (``fedapp.runtime.results.Recorder``) and builds the method's Strategy (a
   ``fedapp.runtime.strategy_base.FedStrategy``); Flower's driver then runs the rounds (with
   ``server-loop`` = async, walk or gossip, ``fedapp.loops`` drives the same Strategy instead).
2. ``FedStrategy.configure_fit`` samples clients and encodes each one's ``fit_payload``
   (``fedapp.runtime.payload``).
3. On each node ``fedapp.client_app`` builds the method's client (a
   ``fedapp.runtime.client_base.FedClient``): it restores its private model from the node's
   state, takes its shard (``fedapp.data``), receives the payload, trains
   (``fedapp.runtime.training``, seeded by ``fedapp.seeding``) and uploads.
4. ``FedStrategy.aggregate_fit`` validates every upload (``accept_upload``), runs the method's
   ``aggregate`` (``fedapp.runtime.aggregate``, ``fedapp.runtime.class_stats``), records bytes
   and metrics and writes a checkpoint when asked (``fedapp.runtime.checkpoint``); evaluation
   follows the same path (``configure_evaluate`` / ``aggregate_evaluate``).
"""
