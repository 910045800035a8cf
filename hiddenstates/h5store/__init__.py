"""The hidden-state store: sharded, compressed Zarr v3 groups committed by Parquet manifests."""

from hiddenstates.h5store.codecs import CODECS, DEFAULT_CODEC, CodecSpec, get_codec
from hiddenstates.h5store.format import FORMAT_VERSION, DatasetInfo, read_dataset_info
from hiddenstates.h5store.reader import Dataset, open_dataset
from hiddenstates.h5store.root import Root, open_root
from hiddenstates.h5store.writer import DatasetWriter, WriterConfig

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "FORMAT_VERSION",
    "CodecSpec",
    "Dataset",
    "DatasetInfo",
    "DatasetWriter",
    "Root",
    "WriterConfig",
    "get_codec",
    "open_dataset",
    "open_root",
    "read_dataset_info",
]
