"""One node's side of a dynamic rendezvous, for ``tether run`` (``python -m
tether.run.rendezvous``): the helper (``helper``), torch's pieces (``torch_rdzv``), what it says
to the launcher (``say``) and how a job of several nodes ends (``end``)."""
