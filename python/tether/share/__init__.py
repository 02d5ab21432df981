"""``tether.share``: one copy of a dataset per machine (``items``: the shared objects;
``meeting``: ``tether.share`` itself, and the meeting point of its key form)."""
