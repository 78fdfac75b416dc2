"""The ``fedapp`` command line.

``main`` is the one parser; ``run`` holds the run, compare, settings, methods and models
commands; ``deploy`` the deployment steps (certificates, keys, SuperLink, SuperNodes, runs);
``flower`` the Flower process control both of them use.
"""
