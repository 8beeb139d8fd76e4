"""The models a command runs by name: the real model fetched from the package registry (fetch.py) and where it is cached."""
