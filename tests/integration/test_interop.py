"""speculators' own data loader reads our prepared dataset and extracted hidden states unchanged."""

import torch


def test_speculators_arrow_dataset_reads_our_files(extracted):
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(max_len=4096, datapath=str(extracted.tokenized), transfer=FileTransfer(extracted.hidden_states),
                      on_missing="raise")
    from eagle3_pipeline.data.tokenized import load_tokenized

    ours = load_tokenized(extracted.tokenized)
    assert len(ds) == len(ours) and ds.approx_lengths == ours["seq_len"]
    H, n_aux = extracted.hidden_size, len(extracted.layer_ids) - 1
    for i in (0, len(ds) // 2, len(ds) - 1):
        item = ds[i]
        T = ours[i]["seq_len"]
        assert item["input_ids"].tolist() == ours[i]["input_ids"]
        assert item["hidden_states"].shape == (T, n_aux * H)          # aux layers, concatenated
        assert item["verifier_last_hidden_states"].shape == (T, H)    # the final layer
        assert item["loss_mask"].tolist() == ours[i]["loss_mask"]
        assert item["hidden_states"].dtype == torch.bfloat16
