"""``srl chaos``: the fault-injection suite (issue 18) and its soak run.

The pipeline of a run (``stage``) and its processes (``cast``), the faults (``catalogue``,
``faults``, ``storefaults``, ``poison``, ``netns`` with ``relay``), what the topics say while
it runs (``watch``) and after (``audit``), the suite's order (``run``), its output
(``report``) and the soak (``soak``, ``soakplot``). docs/reliability.md has the results.
"""
