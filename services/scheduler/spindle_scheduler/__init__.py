"""Spindle's scheduler service: the NATS executor over the policy library (`spindle_policy`).

It subscribes to requests, worker events and the instance registry, feeds them to a `SchedulerCore`, and
publishes the actions the core decides; the core and the strategies never do I/O.
"""
