"""Readers for the standard file formats of MNIST, CIFAR-10 and PTB."""
