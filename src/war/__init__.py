"""WAR: Workload-Aware Rollout for synchronous agentic RL.

Packages (dependencies point one way: rollout -> router -> backends -> engine -> spec):

* ``war.spec``  suffix-tree speculation (SuffixDecoding) with a native core;
* ``war.types`` wire types shared by every part;
* ``war.cli``   the ``war`` command line.
"""

__version__ = "0.1.0"
