"""The ``fedapp`` command line.

``main`` is the one parser; ``run`` holds the run, settings, methods and models commands;
``compare`` the comparison of finished runs; ``deploy`` the deployment steps (certificates,
keys, SuperLink, SuperNodes, runs); ``flower`` the Flower process control both ``run`` and
``deploy`` use.
"""
