"""Spark pipeline example: customers -> one message each -> dramatiq workers -> analytics report."""
