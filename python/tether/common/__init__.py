"""What every room of tether shares: its one pickling (and what travels by
value), the failure reports that carry a child's exception to its parent, its wordings,
its logger, and stacks on demand."""
