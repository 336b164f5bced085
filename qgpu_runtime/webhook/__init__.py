"""Admission webhook: validate GPU requests and fill in what the scheduler and T9k users expect."""
