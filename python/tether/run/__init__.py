"""The Python side of ``tether run``: the ``tether`` command line (``cli``), the warm ranks
(``warm``) and the rendezvous helper (``rendezvous``)."""
