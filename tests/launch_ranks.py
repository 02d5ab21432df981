"""Rank functions for the tests of many ranks: a module that imports nothing, so that a
child that must import it (as a spawn or zygote child does) pays almost nothing."""


def mark(i, flags):
    flags[i] = i + 1
