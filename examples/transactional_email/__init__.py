"""Transactional email: the signup's welcome email exists if and only if the signup commits.

Run it with ``python -m examples.transactional_email`` (see ``README.md``).
"""
