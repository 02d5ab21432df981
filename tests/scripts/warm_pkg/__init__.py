"""The probe of warm ranks, as a package (``-m warm_pkg.probe``)."""
