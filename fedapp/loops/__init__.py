"""The loops room: server loops that are not Flower's synchronous rounds.

``asynchronous`` (AsyncLoop: no round barrier, virtual or arrival clock) and ``relay`` (the
device-to-device WalkLoop and GossipLoop over a ``topology``) drive a method's Strategy through
the Grid calls in ``grid_io``.
"""
