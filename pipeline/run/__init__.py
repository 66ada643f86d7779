"""The step runner: the config, what enters each step's hash, the plan, and the success markers."""
