"""hiddenstates.train"""
