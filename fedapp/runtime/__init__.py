"""The runtime room: what every method's client and server side build on.

``client_base`` (FedClient) and ``strategy_base`` (FedStrategy) are the two bases; ``payload``
is the one wire format and its validation; ``training`` the local training and evaluation
loop; ``aggregate`` and ``class_stats`` the shared maths; ``checkpoint`` and ``results`` what a
run keeps on disk; ``speeds`` how fast each client is (stragglers, the virtual clock).
"""
