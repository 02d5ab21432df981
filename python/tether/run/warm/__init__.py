"""``tether run``'s warm ranks: a node's zygote preloads what the script imports
(``scan``, ``guard``, ``record``), and each rank it forks gets it at its own import
(``serve``); ``start`` is where both begin."""
